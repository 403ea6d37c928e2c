"""Print the versions each matrix leg ran with, whether it passed or not."""

from __future__ import annotations

import pytest

from matrix_support import SUMMARY


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per leg: interpreter, dependency versions, counts, time."""
    lines = terminalreporter.config.stash.get(SUMMARY, [])
    if lines:
        terminalreporter.section("version matrix")
        for line in lines:
            terminalreporter.write_line(line)
