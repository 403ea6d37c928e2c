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
from collections.abc import Iterator

import pytest

from reliable_amqp import Publisher
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark._stream import Connector, end_offset, first_offset
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
    connection = Connector(PublisherOptions.create(amqp_url)).connect()
    try:
        firsts, ends = [], []
        for _ in range(PROBES):
            firsts.append(first_offset(connection, written))
            ends.append(end_offset(connection, written))
    finally:
        connection.close()
    assert None not in firsts, f"first_offset found no message {firsts.count(None)} times"
    assert None not in ends, f"end_offset found no message {ends.count(None)} times"
    pairs = zip(firsts, ends, strict=True)
    assert all(isinstance(f, int) and isinstance(e, int) and f < e for f, e in pairs)
