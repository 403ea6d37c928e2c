"""``spark.read.format("amqp")``: a stream read in one batch, on a real broker and SparkSession."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from support.stream import declare_stream, delete_queue, publish, stream_name

pytestmark = [pytest.mark.spark, pytest.mark.broker]


@pytest.fixture
def stream(amqp_url: str) -> Iterator[str]:
    name = declare_stream(amqp_url, stream_name("batch"))
    yield name
    delete_queue(amqp_url, name)


def _read(spark: SparkSession, url: str, stream: str, **options: str) -> Any:
    reader = spark.read.format("amqp").option("url", url).option("stream", stream)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def test_batch_read_returns_each_message_once_with_contiguous_offsets(
    spark: SparkSession, amqp_url: str, stream: str
) -> None:
    publish(amqp_url, stream, 0, 10_000)
    df = _read(spark, amqp_url, stream, minPartitions="3")
    assert df.rdd.getNumPartitions() == 3
    rows = df.select("message_id", "offset", "value").collect()
    assert len(rows) == 10_000
    assert {r.message_id for r in rows} == {f"m{i}" for i in range(10_000)}
    offsets = sorted(r.offset for r in rows)
    first = offsets[0]
    assert first in (0, 1)  # RabbitMQ counts from 0, LavinMQ from 1
    assert offsets == list(range(first, first + 10_000))
    for r in rows:  # offsets follow publish order
        assert r.value == f"event {r.offset - first}".encode()


@pytest.mark.spark_connect
def test_columns_and_kafka_shaped_headers(spark: SparkSession, amqp_url: str, stream: str) -> None:
    publish(amqp_url, stream, 0, 5)
    df = _read(spark, amqp_url, stream)
    assert [f.name for f in df.schema.fields] == [
        "value", "message_id", "stream", "offset", "routing_key", "exchange", "timestamp",
        "headers", "content_type", "correlation_id", "type",
    ]  # fmt: skip
    assert df.schema["headers"].dataType.simpleString() == (
        "array<struct<key:string,value:binary>>"
    )
    row = df.where(F.col("message_id") == "m3").collect()[0]
    assert row.stream == stream and row.routing_key == stream and row.exchange == ""
    assert row.content_type == "text/plain" and row.correlation_id == "c3"
    assert row.type == "test.event"
    assert int(row.timestamp.timestamp()) == 1_700_000_003
    headers = {h.key: bytes(h.value) for h in row.headers}
    assert headers == {"seq": b"3", "traceparent": f"00-{3:032x}-{3:016x}-01".encode()}


def test_offset_ranges(spark: SparkSession, amqp_url: str, stream: str) -> None:
    publish(amqp_url, stream, 0, 100)
    first = _read(spark, amqp_url, stream).agg(F.min("offset")).collect()[0][0]
    df = _read(
        spark,
        amqp_url,
        stream,
        startingOffsets=str(first + 10),
        endingOffsets=str(first + 30),
        minPartitions="4",
    )
    ids = sorted(int(r.message_id[1:]) for r in df.select("message_id").collect())
    assert ids == list(range(10, 30))
    by_json = _read(
        spark, amqp_url, stream, startingOffsets=f'{{"{stream}": {first + 95}}}'
    ).select("message_id")
    assert sorted(r.message_id for r in by_json.collect()) == [f"m{i}" for i in range(95, 100)]
    assert _read(spark, amqp_url, stream, startingOffsets="latest").count() == 0


def test_empty_stream_reads_nothing(spark: SparkSession, amqp_url: str, stream: str) -> None:
    assert _read(spark, amqp_url, stream).count() == 0
