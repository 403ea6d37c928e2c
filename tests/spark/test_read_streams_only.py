"""Reading refuses what is not a stream (queues are not replayable), names missing streams and
bad options, and reads a super stream's partitions each with its own offsets."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pika
import pytest
from pyspark.sql import SparkSession

from support.stream import declare_stream, delete_queue, publish, stream_name

pytestmark = [pytest.mark.spark, pytest.mark.broker]


def _load(spark: SparkSession, url: str, **options: str) -> Any:
    reader = spark.read.format("amqp").option("url", url)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


@pytest.mark.parametrize(
    "arguments",
    [{}, {"x_queue_type": "quorum"}, {"x_max_length": 1000, "x_expires": 600_000}],
    ids=["classic", "quorum", "classic-with-arguments"],
)
def test_a_queue_is_refused_and_keeps_its_messages(
    spark: SparkSession, broker: Any, amqp_url: str, arguments: dict[str, Any]
) -> None:
    queue = broker.queue(stream_name("queue"), **arguments)
    broker.channel.basic_publish("", queue, b"keep me")
    with pytest.raises(Exception, match=r"not a stream.*reliable_amqp\.Consumer"):
        _load(spark, amqp_url, stream=queue).collect()
    with pytest.raises(Exception, match=r"reliable_amqp\.Consumer"):
        spark.readStream.format("amqp").option("url", amqp_url).option(
            "stream", queue
        ).load().writeStream.format("noop").start().awaitTermination(60)
    assert broker.count(queue) == 1  # never read at-most-once: the message is still there


def test_missing_stream_and_bad_options(spark: SparkSession, amqp_url: str) -> None:
    with pytest.raises(Exception, match="no stream named 'ra-test-nope'"):
        _load(spark, amqp_url, stream="ra-test-nope").collect()
    with pytest.raises(Exception, match=r'needs one of \.option\("stream"'):
        _load(spark, amqp_url).collect()
    with pytest.raises(Exception, match="unknown option 'startingoffset'"):
        _load(spark, amqp_url, stream="s", startingOffset="earliest").collect()
    with pytest.raises(Exception, match="startingOffsets must be earliest, latest"):
        _load(spark, amqp_url, stream="s", startingOffsets="soon").collect()
    with pytest.raises(Exception, match=r"maxMessagesPerTrigger is for spark\.readStream"):
        _load(spark, amqp_url, stream="s", maxMessagesPerTrigger="5").collect()


def test_super_stream_partitions_are_read_with_their_own_offsets(
    spark: SparkSession, amqp_url: str
) -> None:
    # What `rabbitmq-streams add_super_stream NAME --partitions 3` declares, over AMQP 0-9-1:
    # an exchange marked x-super-stream and streams NAME-0..2 bound with keys 0..2. LavinMQ has
    # no super streams of its own, but takes the same exchange and streams, read the same way.
    name = stream_name("super")
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.exchange_declare(name, "direct", durable=True, arguments={"x-super-stream": True})
    try:
        for p in range(3):
            declare_stream(amqp_url, f"{name}-{p}")
            channel.queue_bind(
                f"{name}-{p}", name, str(p), arguments={"x-stream-partition-order": p}
            )
        for p, count in enumerate((30, 20, 10)):
            publish(amqp_url, str(p), p * 1000, count, exchange=name)
        df = _load(spark, amqp_url, superStream=name, minPartitions="6")
        rows = df.select("stream", "offset", "message_id", "exchange").collect()
        by_stream: dict[str, list[int]] = defaultdict(list)
        for r in rows:
            assert r.exchange == name
            assert int(r.message_id[1:]) // 1000 == int(r.stream.rsplit("-", 1)[1])
            by_stream[r.stream].append(r.offset)
        assert {s: len(o) for s, o in by_stream.items()} == {
            f"{name}-0": 30,
            f"{name}-1": 20,
            f"{name}-2": 10,
        }
        for offsets in by_stream.values():  # each partition counts its own offsets
            first = min(offsets)  # RabbitMQ counts a stream's offsets from 0, LavinMQ from 1
            assert first in (0, 1)
            assert sorted(offsets) == list(range(first, first + len(offsets)))
        assert {r.message_id for r in rows} == {
            f"m{p * 1000 + i}" for p, n in enumerate((30, 20, 10)) for i in range(n)
        }
    finally:
        for p in range(3):
            delete_queue(amqp_url, f"{name}-{p}")
        channel.exchange_delete(name)
        connection.close()
