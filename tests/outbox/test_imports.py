"""The outbox imports no database driver it is not asked to use.

Here every optional stack is installed (the main venv has them all), so the check can fail: a
module that imported psycopg or PyMySQL at the top would load 50-100 ms of driver for an
application on SQLite. The version matrix runs the same script where none is installed
(tests/matrix), which shows the library works without them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from support.matrix import OPTIONAL, WITHOUT_OPTIONAL


def test_every_optional_stack_is_installed_here() -> None:
    """Else the test below would pass for want of the packages, not for the imports' sake."""
    missing = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    assert not missing, f"the main venv lacks {missing}: scripts/dev.sh installs every extra"


def test_the_outbox_on_sqlite_imports_no_driver() -> None:
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPTIONAL, *OPTIONAL],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
