"""Offset ranges that cannot be read fail when the read is planned, with the reason (issue 45,
item 7): ``endingOffsets`` before ``startingOffsets``, ``startingOffsets`` past the stream's
end, ``endingOffsets`` past the stream's end (it used to wait 60 s per task attempt and then
raise ``StreamReadStalled`` without naming the cause; the others read 0 rows without a word).
A stream never written reads as empty, from its start, without error. A task that stalls says
where the stream is.

Portable: offsets are taken from the stream's first one (RabbitMQ counts from 0, LavinMQ
from 1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark import StreamReadStalled
from reliable_amqp.spark._stream import Connector, first_offset, read_range
from support.stream import declare_stream, delete_queue, publish, stream_name

pytestmark = [pytest.mark.spark, pytest.mark.broker]


@pytest.fixture
def stream(amqp_url: str) -> Iterator[str]:
    name = declare_stream(amqp_url, stream_name("ranges"))
    yield name
    delete_queue(amqp_url, name)


def _batch(spark: SparkSession, url: str, stream: str, **options: str) -> Any:
    reader = spark.read.format("amqp").option("url", url).option("stream", stream)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _first(url: str, stream: str) -> int:
    connector = Connector(PublisherOptions.create(url))
    found = connector.probing(lambda c: first_offset(c, stream, held=True))
    assert found is not None
    return found


def test_impossible_ranges_fail_at_planning_with_the_reason(
    spark: SparkSession, amqp_url: str, stream: str
) -> None:
    publish(amqp_url, stream, 0, 100)
    first = _first(amqp_url, stream)
    last = first + 99

    with pytest.raises(Exception, match=rf"endingOffsets {first + 5} is before startingOffsets"):
        _batch(
            spark, amqp_url, stream, startingOffsets=str(first + 10), endingOffsets=str(first + 5)
        ).collect()

    with pytest.raises(
        Exception,
        match=rf"startingOffsets {first + 150} is past the stream's end: the stream's last "
        rf"offset is {last}",
    ):
        _batch(spark, amqp_url, stream, startingOffsets=str(first + 150)).collect()

    began = time.monotonic()
    with pytest.raises(
        Exception,
        match=rf"endingOffsets {first + 150} is past the stream's end: the stream's last "
        rf"offset is {last}",
    ):
        _batch(spark, amqp_url, stream, endingOffsets=str(first + 150)).collect()
    assert time.monotonic() - began < 30  # (at once: it used to take 60 s per task attempt)

    with pytest.raises(Exception, match=rf"startingOffsets {first + 150} is past the stream's end"):
        (
            spark.readStream.format("amqp")
            .option("url", amqp_url)
            .option("stream", stream)
            .option("startingOffsets", str(first + 150))
            .load()
            .writeStream.format("noop")
            .start()
            .awaitTermination(120)
        )

    # the edges are fine: a range ending at the stream's end, and one empty by its own bounds
    assert _batch(spark, amqp_url, stream, endingOffsets=str(first + 100)).count() == 100
    assert _batch(spark, amqp_url, stream, startingOffsets=str(first + 100)).count() == 0


def test_a_stream_never_written_reads_as_empty_without_error(
    spark: SparkSession, amqp_url: str, stream: str
) -> None:
    assert _batch(spark, amqp_url, stream).count() == 0
    assert _batch(spark, amqp_url, stream, startingOffsets="0").count() == 0  # (LavinMQ: from 1)
    with pytest.raises(Exception, match="endingOffsets 5 is past the stream's end: the stream "):
        _batch(spark, amqp_url, stream, endingOffsets="5").collect()


def test_a_stalled_task_says_where_the_stream_ends(amqp_url: str, stream: str) -> None:
    """A range past the stream's end (planning refuses one; a stream deleted and declared
    again, or a hand-made range, still gets here): the stall names the stream's offsets."""
    publish(amqp_url, stream, 0, 10)
    first = _first(amqp_url, stream)
    connector = Connector(PublisherOptions.create(amqp_url))
    read: list[int] = []
    with pytest.raises(StreamReadStalled) as stalled:
        for chunk in read_range(connector, stream, first, first + 20, stall_timeout=3):
            read += chunk.offsets
    assert read == list(range(first, first + 10))
    assert (
        f"the stream holds offsets {first}..{first + 9} now: offsets {first + 10}..{first + 19} "
        "do not exist yet"
    ) in str(stalled.value)
