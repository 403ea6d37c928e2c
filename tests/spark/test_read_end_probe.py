"""The end probe takes no idle wait where the broker can say where a stream ends (issue 45:
on LavinMQ it cost about 1.06 s per read, so every batch read and every streaming trigger paid
it).

RabbitMQ answers a ``basic.qos`` after the deliveries it had at hand (a barrier); LavinMQ does
not, but its ``queue.declare-ok`` counts a stream's messages and its offsets are one per
message, so the end is the first offset plus the count, checked by a consumer at ``end - 1``
that must get that very offset. A count that does not check out is not trusted: the probe then
reads the stream's last part as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from reliable_amqp._core.brokers import ANY_BROKER, LAVINMQ, RABBITMQ, BrokerLimits
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark import _stream
from reliable_amqp.spark._stream import Connector, end_offset, first_offset
from support.memory import fill_numbered
from support.stream import declare_stream, delete_queue, stream_name

COUNT = 20_000


class _Connected:
    """What the probes read of a pika connection: the broker's ``server_properties``."""

    def __init__(self, product: str | None) -> None:
        self._impl = type("Impl", (), {"server_properties": {"product": product}})()


@pytest.mark.parametrize(
    ("product", "limits"),
    [("LavinMQ", LAVINMQ), ("RabbitMQ", RABBITMQ), ("Qpid", ANY_BROKER), (None, ANY_BROKER)],
)
def test_the_end_probe_takes_its_path_from_the_broker_table(
    product: str | None, limits: BrokerLimits
) -> None:
    """Which way the end is found is a field of the broker's entry (``_core/brokers.py``), not
    a comparison of entries: LavinMQ counts (``stream_count_is_span``), RabbitMQ has the
    barrier (``stream_qos_barrier``), a broker not in the table neither (it probes and waits)."""
    connection: Any = _Connected(product)
    assert _stream._broker(connection) is limits
    assert _stream._counts_stream(connection) is (product == "LavinMQ")
    assert _stream._in_order(connection) is (product == "RabbitMQ")


@pytest.fixture
def full(amqp_url: str) -> Iterator[str]:
    name = declare_stream(amqp_url, stream_name("end"))
    fill_numbered(amqp_url, name, COUNT)
    yield name
    delete_queue(amqp_url, name)


def _probe(url: str, stream: str) -> tuple[int | None, int | None, float]:
    connector = Connector(PublisherOptions.create(url))

    def look(connection: Any) -> tuple[int | None, int | None, float]:
        first = first_offset(connection, stream, held=True)
        began = time.monotonic()
        end = end_offset(connection, stream)
        return first, end, time.monotonic() - began

    return connector.probing(look)


@pytest.mark.broker
def test_the_end_of_a_stream_at_rest_comes_without_an_idle_wait(amqp_url: str, full: str) -> None:
    """Exact, and quick: best of three under 0.5 s (RabbitMQ 3.10 here: 0.01 to 0.06 s; the
    idle wait alone is 0.25 s, and LavinMQ's probe read its last 8 MiB segment first)."""
    looks = [_probe(amqp_url, full) for _ in range(3)]
    first = looks[0][0]
    assert first is not None
    assert all(end == first + COUNT for _, end, _ in looks), looks
    assert min(seconds for _, _, seconds in looks) < 0.5, looks


@pytest.mark.broker
@pytest.mark.parametrize("count", [0, COUNT + 5, COUNT * 2])
def test_a_message_count_that_does_not_check_out_is_not_trusted(
    amqp_url: str, full: str, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """The counting path forced on whatever broker this is, with a count past the stream's
    messages (offsets that do not exist) or 0 (what RabbitMQ 3.10 answers for a stream until
    its stats catch up): the end is still the stream's. (A count below the stream's would pass
    the check, which proves only that ``end - 1`` exists: the path is LavinMQ's alone, whose
    count is its stream's number of messages, one offset each.)"""
    monkeypatch.setattr(_stream, "_counts_stream", lambda connection: True)
    monkeypatch.setattr(_stream, "_message_count", lambda connection, queue: count)
    first, end, _ = _probe(amqp_url, full)
    assert first is not None and end == first + COUNT
