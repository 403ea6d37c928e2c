"""The driver's probes run on a connection of their own and survive the broker closing it.

RabbitMQ 3.10 closes a connection with 541 INTERNAL_ERROR when a probe's consumer starts on a
segment that retention is deleting (its channel crashes in ``begin_stream``: seen in 2 of 3 runs
of 150 probes of a stream written and trimmed). That cannot be brought about on purpose, so
these tests hand :meth:`Connector.probing` connections that the "broker" closes, and check what
it does with them: run the probe again on a new connection, close every one, give up after
:data:`PROBE_ATTEMPTS` with the library's error, and never retry what is not a lost connection.
"""

from __future__ import annotations

from typing import Any

import pika.exceptions
import pytest

from reliable_amqp import ReliableAmqpError
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark import _stream
from reliable_amqp.spark._stream import PROBE_ATTEMPTS, Connector, NotAStream


class _Connection:
    """What probing() touches of a connection: is_open and close()."""

    def __init__(self) -> None:
        self.is_open = True

    def close(self) -> None:
        self.is_open = False


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[_Connection]:
    """Every connection Connector.connect() handed out, in order."""
    made: list[_Connection] = []

    def connect(self: Connector, *, scanning: bool = False) -> Any:
        made.append(_Connection())
        return made[-1]

    monkeypatch.setattr(_stream.Connector, "connect", connect)
    return made


CONNECTOR = Connector(PublisherOptions.create("amqp://guest:guest@127.0.0.1:5672/%2F"))


def _closed_by_broker() -> pika.exceptions.ConnectionClosedByBroker:
    return pika.exceptions.ConnectionClosedByBroker(541, "INTERNAL_ERROR")


def test_a_probe_whose_connection_the_broker_closed_runs_again_on_a_new_one(
    opened: list[_Connection],
) -> None:
    calls: list[Any] = []

    def probe(connection: Any) -> int:
        calls.append(connection)
        if len(calls) == 1:
            connection.is_open = False
            raise _closed_by_broker()
        return 42

    assert CONNECTOR.probing(probe) == 42
    assert calls == opened and len(opened) == 2
    assert not any(c.is_open for c in opened)


def test_a_probe_gives_up_after_its_attempts_with_the_librarys_error(
    opened: list[_Connection],
) -> None:
    def probe(connection: Any) -> int:
        raise _closed_by_broker()

    with pytest.raises(ReliableAmqpError) as raised:
        CONNECTOR.probing(probe)
    assert isinstance(raised.value.__cause__, pika.exceptions.ConnectionClosedByBroker)
    assert "INTERNAL_ERROR" in str(raised.value) or "541" in str(raised.value), raised.value
    assert len(opened) == PROBE_ATTEMPTS
    assert not any(c.is_open for c in opened)


def test_what_is_not_a_lost_connection_is_not_probed_again(opened: list[_Connection]) -> None:
    def probe(connection: Any) -> int:
        raise NotAStream("'orders' is a queue, not a stream")

    with pytest.raises(NotAStream):
        CONNECTOR.probing(probe)
    assert len(opened) == 1 and not opened[0].is_open
