"""The README's first screen is for users (issue 42): within its first 45 lines a fresh clone
shows the two commands CI's rule keeps at the top, ``pip install``, and a first example that
works as written (run here against the real broker, on a queue of the test's own)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.broker import BrokerAdmin, unique

README = Path(__file__).resolve().parent.parent / "README.md"
FIRST_SCREEN = 45


def _first_screen() -> str:
    return "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN])


def _first_example() -> str:
    found = re.search(r"```python\n(.*?)```", _first_screen(), re.DOTALL)
    assert found is not None, f"no complete python example in the README's first {FIRST_SCREEN}"
    return found[1]


def test_the_first_screen_has_the_two_commands_pip_install_and_an_example() -> None:
    screen = _first_screen()
    commands = screen.index("bash scripts/dev.sh main"), screen.index("bash scripts/dev.sh test")
    assert max(commands) < screen.index("pip install"), "the two commands come first"
    assert "from reliable_amqp import Publisher" in _first_example()


@pytest.mark.broker
def test_the_first_example_runs_as_written(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue(unique("readme"))  # deleted after the test
    code = _first_example()
    assert code.count('"orders"') >= 2 and "amqp://guest:guest@127.0.0.1:5672/%2F" in code
    code = code.replace('"orders"', repr(queue)).replace(
        "amqp://guest:guest@127.0.0.1:5672/%2F", amqp_url
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1000 confirmed", result.stdout
    assert broker.count(queue) == 1000
