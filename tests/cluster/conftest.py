"""Print the RabbitMQ 4 headlines (broker and client versions, counts) at the end of the run."""

from __future__ import annotations

import pytest

from harness.rabbitmq4_fixtures import terminal_summary


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per RabbitMQ 4 leg and cluster case."""
    terminal_summary(terminalreporter, "rabbitmq 4")
