"""A Spark task reading a stream holds what ``prefetch`` and one Arrow batch hold, not its range.

docs/spark.md: "what a task holds is bounded by prefetch". A child process runs a task's read
(``read_partition``: the range read, then Arrow record batches of 5,000 rows, each dropped as
Spark would after handing it on) over a stream of 450,000 messages and reports its resident
set's growth, from after a 50,000-row warm-up, at 100,000 and at 400,000 rows read.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from support.memory import MARKS, check_flat, fill_numbered, run_child, sample
from support.stream import declare_stream, delete_queue, stream_name

pytestmark = [pytest.mark.broker, pytest.mark.spark, pytest.mark.slow]

#: rows read before the baseline: a task's first 50,000 rows grow its resident set by steps
#: (Arrow's allocator, pika's buffers, Python's arenas) that stop there, 1,600,000 rows read
WARM_UP = 50_000


def _read_rss(url: str, stream: str) -> list[tuple[int, int]]:
    """The child's part: one task's read of WARM_UP + MARKS[-1] offsets from the stream's
    first; the growth at the marks."""
    from reliable_amqp.spark._read import StreamRange, read_partition
    from reliable_amqp.spark._read_options import ReadConfig
    from reliable_amqp.spark._stream import lowest_offset

    total = WARM_UP + MARKS[-1]
    config = ReadConfig.from_strings({"url": url, "stream": stream}, streaming=False)
    grown: list[tuple[int, int]] = []
    before: tuple[int, int] | None = None
    rows = 0
    pending = list(MARKS)
    connection = config.connector.connect()
    try:  # RabbitMQ counts a stream's offsets from 0, LavinMQ from 1
        first = lowest_offset(connection)
    finally:
        connection.close()
    for batch in read_partition(StreamRange(stream, first, first + total, config)):
        rows += batch.num_rows
        del batch
        if before is None:
            if rows >= WARM_UP:
                before = sample()
        elif pending and rows - WARM_UP >= pending[0]:
            pending.pop(0)
            now = sample()
            grown.append((now[0] - before[0], now[1] - before[1]))
    assert rows == total, rows
    return grown


@pytest.fixture
def full_stream(amqp_url: str) -> Iterator[str]:
    name = declare_stream(amqp_url, stream_name("memory"))
    try:
        fill_numbered(amqp_url, name, WARM_UP + MARKS[-1])
        yield name
    finally:
        delete_queue(amqp_url, name)


def test_a_task_reading_a_range_does_not_grow_with_it(amqp_url: str, full_stream: str) -> None:
    # RSS moves by up to 8 MB between the marks here (Arrow's allocator, pika's buffers): 16 MB
    # still fails a batch kept (1.5 MB each, 60 of them); Python's blocks catch a kept offset
    grown = run_child(__file__, amqp_url, full_stream)
    check_flat("spark read task", grown, flat=16 * 2**20)


if __name__ == "__main__":  # the child: URL STREAM
    print(json.dumps(_read_rss(sys.argv[1], sys.argv[2])))
