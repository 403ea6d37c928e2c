"""A stream that retention emptied reads as a loss, not as "nothing new" (issue 45, item 6).

A stream that holds no message answers like one never written; what tells them apart is an
offset the query remembers: a checkpoint at offset 10 knows the stream held offsets 0..9, so a
stream that now holds nothing has lost whatever followed them. Under the default
``failOnDataLoss`` that fails the query (``StreamDataLost``), streaming and batch; with
``failOnDataLoss=false`` it is a WARNING, once, and the query goes on. A stream never written
reads as empty without a word (tests/spark/test_read_ranges.py).

How retention empties a stream here, on RabbitMQ 3.10 and 4.3 alike: segments of 20 KB, at
most 20 KB kept; a 25 KB message fills a segment by itself, the broker starts a new (empty)
segment after it, and retention then removes every older segment, the big message's with them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.streaming.datasource import ReadAllAvailable

from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark import StreamDataLost, _stream
from reliable_amqp.spark._read import AmqpBatchReader, AmqpStreamReader, StreamRange
from reliable_amqp.spark._read_options import ReadConfig
from reliable_amqp.spark._stream import Connector, end_offset, first_offset, read_range
from support.stream import declare_stream, delete_queue, publish, stream_name, wait_for

pytestmark = [
    pytest.mark.spark,
    pytest.mark.broker,
    pytest.mark.slow,
    pytest.mark.rabbitmq_only(reason="x-stream-max-segment-size-bytes empties the stream at once"),
]

EMPTIED = r"holds no message, yet this read is at offset 10"


@pytest.fixture
def stream(amqp_url: str) -> Any:
    name = declare_stream(
        amqp_url,
        stream_name("emptied"),
        x_max_length_bytes=20_000,
        x_stream_max_segment_size_bytes=20_000,
    )
    yield name
    delete_queue(amqp_url, name)


def _holds_nothing(url: str, stream: str) -> bool:
    connector = Connector(PublisherOptions.create(url))
    return connector.probing(
        lambda c: end_offset(c, stream) is None and first_offset(c, stream) is None
    )


def _empty_by_retention(url: str, stream: str, start: int) -> None:
    """20 messages nobody reads (offsets ``start``..), then one that fills a segment: retention
    removes them all."""
    publish(url, stream, start, 20, size=1000, max_in_flight=10)
    publish(url, stream, start + 20, 1, size=25_000)
    wait_for(lambda: _holds_nothing(url, stream), 60, "retention to empty the stream")


def _query(spark: SparkSession, url: str, stream: str, out: Path, checkpoint: Path) -> Any:
    return (
        spark.readStream.format("amqp")
        .option("url", url)
        .option("stream", stream)
        .option("startingOffsets", "earliest")
        .load()
        .select("message_id", "offset")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def _batch(spark: SparkSession, url: str, stream: str, **options: str) -> Any:
    reader = spark.read.format("amqp").option("url", url).option("stream", stream)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def test_a_checkpoint_whose_stream_retention_emptied_fails_the_query(
    spark: SparkSession, amqp_url: str, stream: str, tmp_path: Path
) -> None:
    """The issue's case: run 1 commits offsets 0..9, retention removes every message, run 2
    on the same checkpoint fails (it finished with 0 rows and no word); so does a batch read
    from offset 10. A read from the stream's start (earliest) has nothing to miss."""
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    publish(amqp_url, stream, 0, 10, size=1000, max_in_flight=10)
    first = _query(spark, amqp_url, stream, out, checkpoint)
    first.awaitTermination(180)
    assert first.exception() is None
    assert spark.read.parquet(str(out)).count() == 10

    _empty_by_retention(amqp_url, stream, 10)

    again = _query(spark, amqp_url, stream, out, checkpoint)
    with pytest.raises(Exception, match=EMPTIED) as failed:
        again.awaitTermination(180)
    assert "failOnDataLoss" in str(failed.value)
    assert spark.read.parquet(str(out)).count() == 10  # (nothing was added)

    with pytest.raises(Exception, match=EMPTIED):
        _batch(spark, amqp_url, stream, startingOffsets="10").collect()
    assert _batch(spark, amqp_url, stream).count() == 0  # earliest: what the stream holds


def test_with_fail_on_data_loss_off_the_loss_is_warned_of_once(
    amqp_url: str, stream: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's side of a micro-batch (what Spark's Python worker runs), called here: the
    emptied stream under a checkpoint at offset 10 is a WARNING, once for that offset, and the
    query waits at 10 (the next message's offset tells how many were lost: check_heads). A
    batch read from 10 plans nothing to read, with the same WARNING."""
    monkeypatch.setattr(_stream, "EMPTY_CONFIRM", 1.0)
    publish(amqp_url, stream, 0, 10, size=1000, max_in_flight=10)
    _empty_by_retention(amqp_url, stream, 10)
    options = {"url": amqp_url, "stream": stream, "failondataloss": "false"}
    reader = AmqpStreamReader(ReadConfig.from_strings(options, streaming=True))
    with caplog.at_level(logging.WARNING, logger="reliable_amqp.spark"):
        assert reader.latestOffset({stream: 10}, ReadAllAvailable()) == {stream: 10}
        assert reader.latestOffset({stream: 10}, ReadAllAvailable()) == {stream: 10}
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "reliable_amqp.spark" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    assert "holds no message, yet this read is at offset 10" in warnings[0]
    assert "failOnDataLoss=false" in warnings[0]

    failing = AmqpStreamReader(ReadConfig.from_strings({**options, "failondataloss": "true"}, True))
    with pytest.raises(StreamDataLost, match=EMPTIED) as lost:
        failing.latestOffset({stream: 10}, ReadAllAvailable())
    assert (lost.value.start, lost.value.first) == (10, None)

    # a batch read from offset 10 (its planning, as Spark's driver-side worker runs it)
    caplog.clear()
    batch = {**options, "startingoffsets": "10"}
    with caplog.at_level(logging.WARNING, logger="reliable_amqp.spark"):
        parts = AmqpBatchReader(ReadConfig.from_strings(batch, streaming=False)).partitions()
    assert [(p.start, p.end) for p in parts if isinstance(p, StreamRange)] == [(0, 0)]
    assert any(EMPTIED in r.getMessage() for r in caplog.records)


def test_a_task_whose_range_retention_emptied_fails_at_once(
    amqp_url: str, stream: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's range [0, 10) was fixed while the stream held it; retention then emptied the
    stream. The task reports the loss within seconds (it used to wait for its stall timeout
    and raise StreamReadStalled, and Spark's retries waited again)."""
    monkeypatch.setattr(_stream, "EMPTY_CHECK", 1.5)  # (5 s and 3 s by default)
    monkeypatch.setattr(_stream, "EMPTY_CONFIRM", 1.0)
    publish(amqp_url, stream, 0, 10, size=1000, max_in_flight=10)
    _empty_by_retention(amqp_url, stream, 10)
    connector = Connector(PublisherOptions.create(amqp_url))
    began = time.monotonic()
    with pytest.raises(StreamDataLost, match="holds no message, yet this read is at offset 0"):
        list(read_range(connector, stream, 0, 10, stall_timeout=30))
    assert time.monotonic() - began < 20

    with caplog.at_level(logging.WARNING, logger="reliable_amqp.spark"):
        assert list(read_range(connector, stream, 0, 10, fail_on_data_loss=False)) == []
    assert any(
        "skipped offsets 0..9: retention emptied the stream" in r.getMessage()
        for r in caplog.records
    )
