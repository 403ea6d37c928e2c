"""``pytest --cov``, the way most contributors measure coverage, works on this suite (issue 42).

``scripts/dev.sh coverage`` runs ``coverage run -m pytest``; many run ``pytest --cov`` instead,
where pytest-cov starts coverage's tracer inside pytest's own process. The interrupt-point
sweep (tests/test_interrupt_points.py) raises ``KeyboardInterrupt`` from a ``sys.setprofile``
hook, which must fire only in the call under test, never in pytest's or coverage's machinery
(once it did, a run ended in an INTERNALERROR while pytest formatted a failure). Here a child
pytest runs two of the sweeps under ``--cov`` and a failing test after a sweep-style interrupt:
the sweeps pass, the failure is reported as a failure, and coverage reports the library.

Give ``--cov`` the package (``reliable_amqp``) or a directory (``src/reliable_amqp/_async``),
not a dotted subpackage: on CPython 3.11.7 ``--cov=reliable_amqp._async`` (or any dotted name,
``--cov=asyncio.tasks`` too) makes nine async adapter tests fail with ``CancelledError``
(tests/adapters: the heartbeat test's "3 left" among them; they pass with asyncio's pure-Python
Task), and the coroutines they leave behind, reported while pytest parses a file, end the run
in CPython's "AST constructor recursion depth mismatch" (gh-106905, fixed in 3.11.8).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.broker]  # the sweeps publish to the shared broker

TESTS = Path(__file__).parent

#: a failure pytest has to format after an interrupt of the sweep's kind was raised and caught
FAILING = """
from reliable_amqp._core.window import Window
from test_interrupt_points import _interrupted


def test_a_failure_after_an_interrupt_is_reported_as_one():
    # the library's code is swept: its first point is the entry of Window.__init__
    assert _interrupted(lambda: Window(10, 10_000).try_issue(5), 1).startswith("point 1:")
    assert {"answer": 41} == {"answer": 42}
"""


def test_pytest_cov_runs_the_interrupt_sweeps_and_reports_a_failure(tmp_path: Path) -> None:
    failing = tmp_path / "test_failing_after_an_interrupt.py"  # (not in tests/: never collected)
    failing.write_text(FAILING)
    # the child runs its own pytest: none of this run's options, xdist or coverage settings
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "COV_CORE", "COVERAGE_"))
    }
    env["COVERAGE_FILE"] = str(tmp_path / ".coverage")  # not the checkout's
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--cov=reliable_amqp",
            "--cov-report=term",
            "-c",
            str(TESTS.parent / "pyproject.toml"),
            "--rootdir",
            str(TESTS.parent),
            str(TESTS / "test_interrupt_points.py"),
            "-k",
            "spooled_publish or anywhere_in_publish_leaks or failure_after",
            str(failing),
        ],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = done.stdout + done.stderr
    shown = out[max(0, out.find("= FAILURES =")) :][:6000]
    assert "INTERNALERROR" not in out, shown
    assert done.returncode == 1, shown  # tests failed (3 would be an internal error)
    assert "1 failed, 2 passed" in out, shown
    assert "assert {'answer': 41} == {'answer': 42}" in out, shown  # the failure, formatted
    assert "src/reliable_amqp/_sync/publisher.py" in out, shown  # coverage's report
