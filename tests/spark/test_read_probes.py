"""The driver's offset probes never call a stream that holds messages empty, while it is written
and while retention removes its segments.

There is no AMQP 0-9-1 method that tells a stream's first or last offset: the probes read them
(``first_offset``: a consumer at ``first``; ``end_offset``: one at ``last``). RabbitMQ usually
sends those deliveries before its answer to the channel's next method, but not always: while
the stream was written, 1 to 14 probes in 180 saw nothing by that answer (3.10 and 4.3), and a
probe that took that for "empty" failed a query's next micro-batch ("its first offset did not
come") or made a batch read of a full stream read nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reliable_amqp import Publisher
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark import _stream
from reliable_amqp.spark._stream import Connector, end_offset, first_offset
from support.memory import fill_numbered
from support.stream import declare_stream, delete_queue, stream_name

pytestmark = [pytest.mark.broker]

PROBES = 40


@pytest.fixture(params=["growing", "growing-and-trimmed"])
def written(request: pytest.FixtureRequest, amqp_url: str) -> Iterator[str]:
    """A stream that holds messages and is being written (and, for the second, trimmed by
    retention: small segments under a small length limit) for as long as the test runs."""
    trimmed = request.param == "growing-and-trimmed"
    limits = {"x_max_length_bytes": 100_000, "x_stream_max_segment_size_bytes": 20_000}
    name = declare_stream(amqp_url, stream_name("probe"), **(limits if trimmed else {}))
    stop = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            with Publisher(amqp_url) as publisher:
                while not stop.is_set():
                    publisher.publish_many("", name, [b"x" * 1000] * 20)
                    assert publisher.flush(30) == 0
        except BaseException as exc:  # the test reports it
            failures.append(exc)

    with Publisher(amqp_url) as publisher:
        publisher.publish_many("", name, [b"x" * 1000] * 50)
        assert publisher.flush(30) == 0
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield name
    finally:
        stop.set()
        writer.join(60)
        delete_queue(amqp_url, name)
    assert not failures, failures


def test_probes_of_a_written_stream_always_find_its_offsets(amqp_url: str, written: str) -> None:
    # as the driver probes: each on a connection of its own (Connector.probing: RabbitMQ 3.10
    # sometimes closes one, 541, when a probe starts on a segment retention is deleting), the
    # first offset of a stream known to hold messages
    connector = Connector(PublisherOptions.create(amqp_url))
    firsts, ends = [], []
    for _ in range(PROBES):
        firsts.append(connector.probing(lambda c: first_offset(c, written, held=True)))
        ends.append(connector.probing(lambda c: end_offset(c, written)))
    assert None not in firsts, f"first_offset found no message {firsts.count(None)} times"
    assert None not in ends, f"end_offset found no message {ends.count(None)} times"
    pairs = zip(firsts, ends, strict=True)
    assert all(isinstance(f, int) and isinstance(e, int) and f < e for f, e in pairs)


WINDOW_TOTAL = 5_000


def test_the_end_probe_returns_credit_when_a_whole_window_came_before_its_idle_wait(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LavinMQ sends a new consumer its whole window (the probe's prefetch, 1,000) at once, and
    its ``last`` is the start of the stream's last segment (8 MiB: every message here). The end
    probe acked only what came during its idle wait, so with the window already in hand it
    acked nothing, got nothing more, and called offset 1,000 the end (seen on LavinMQ 2.9.1:
    a batch read of 10,000 read 1,000). RabbitMQ is made to look the same here: not taken for
    a broker that answers in order, the probe starting at the first offset, and the first wait
    lasting until the whole window came. The probe must still read to the stream's end."""
    name = declare_stream(amqp_url, stream_name("window"))
    try:
        fill_numbered(amqp_url, name, WINDOW_TOTAL)
        waited: list[int] = []

        def from_first(channel: Any, queue: str, on_message: Any, where: Any, **kw: Any) -> None:
            real_consume(channel, queue, on_message, "first" if where == "last" else where, **kw)

        def whole_window(channel: Any, connection: Any, got: list[Any], prefetch: int) -> None:
            real_await_first(channel, connection, got, prefetch)
            deadline = time.monotonic() + 60
            while len(got) < prefetch and time.monotonic() < deadline:
                connection.process_data_events(0.02)
            waited.append(len(got))

        real_consume, real_await_first = _stream._consume, _stream._await_first
        monkeypatch.setattr(_stream, "_in_order", lambda _connection: False)
        # the idle-wait probe itself: not LavinMQ's count of the stream (test_read_end_probe.py)
        monkeypatch.setattr(_stream, "_counts_stream", lambda _connection: False)
        # what is tested is the credit, not the probe's time limits: a loaded machine must not
        # make the probe stop early and give a lower bound (the old code stops at the window
        # whatever they are)
        monkeypatch.setattr(_stream, "END_BUDGET", 120.0)
        monkeypatch.setattr(_stream, "END_IDLE", 2.0)
        monkeypatch.setattr(_stream, "_consume", from_first)
        monkeypatch.setattr(_stream, "_await_first", whole_window)
        connection = Connector(PublisherOptions.create(amqp_url)).connect()
        try:
            end = end_offset(connection, name)
            lowest = _stream.lowest_offset(connection)  # RabbitMQ's first offset is 0, LavinMQ's 1
        finally:
            connection.close()
        # the window was in hand before the idle wait (RabbitMQ sends whole chunks: 1,000 or
        # a few more)
        assert len(waited) == 1 and waited[0] >= 1000, waited
        assert end == lowest + WINDOW_TOTAL
    finally:
        delete_queue(amqp_url, name)
