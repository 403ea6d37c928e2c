"""Pytest support for the RabbitMQ 4 tests (tests/rabbitmq4, tests/cluster).

- :data:`SUMMARY`: headlines (broker and client versions, counts) printed at the end of the run
  by the conftest of those directories, as the version matrix prints its legs.
- :func:`broker_versions`: what a RabbitMQ node says about itself when a client connects.
"""

from __future__ import annotations

import pika
import pytest

__all__ = ["SUMMARY", "add_summary", "broker_versions", "terminal_summary"]

#: one line per RabbitMQ 4 leg or cluster case run
SUMMARY = pytest.StashKey[list[str]]()
_PRINTED = pytest.StashKey[bool]()


def broker_versions(url: str) -> dict[str, str]:
    """{"product": "RabbitMQ", "version": "4.3.6", "platform": "Erlang/OTP 29.1.1"} of ``url``."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        props = connection._impl.server_properties
    finally:
        connection.close()
    return {
        key: value.decode() if isinstance(value, bytes) else str(value)
        for key, value in props.items()
        if key in ("product", "version", "platform")
    }


def add_summary(config: pytest.Config, line: str) -> None:
    """Print ``line`` now (test output) and in the run's summary."""
    config.stash.setdefault(SUMMARY, []).append(line)
    print(line)


def terminal_summary(terminalreporter: pytest.TerminalReporter, title: str) -> None:
    """The conftest hook's body: the collected lines under ``title``."""
    stash = terminalreporter.config.stash
    lines = stash.get(SUMMARY, [])
    if lines and not stash.get(_PRINTED, False):  # both directories' conftests call this
        stash[_PRINTED] = True
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
