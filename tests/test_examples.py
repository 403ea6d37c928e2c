"""Every example in examples/ runs against the real broker as written, and exits 0.

The Spark examples (``examples/spark_*.py``) are run by ``tests/spark``, with a SparkSession.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.broker import BrokerAdmin, unique

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.glob("*.py") if not p.name.startswith("spark_"))


def test_there_are_examples() -> None:
    assert {p.name for p in SCRIPTS} >= {
        "quickstart.py",
        "threads.py",
        "nacks_and_returns.py",
        "retry_policies.py",
    }


@pytest.mark.broker
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_example_runs(script: Path, amqp_url: str, broker: BrokerAdmin, tmp_path: Path) -> None:
    env = {**os.environ, "AMQP_URL": amqp_url}
    if script.name == "quickstart.py":
        # quickstart.py's queue outlives it (a newcomer looks at it; it takes back only its own
        # messages); here it gets one of the test's own, deleted after the test.
        env["QUICKSTART_QUEUE"] = unique("quickstart")
        broker.channel.queue_declare(env["QUICKSTART_QUEUE"], durable=True)
        broker._queues.append(env["QUICKSTART_QUEUE"])
    result = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # examples must not depend on the working directory
        timeout=240,
    )
    assert result.returncode == 0, (
        f"{script.name} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    assert result.stdout.strip(), f"{script.name} printed nothing"
