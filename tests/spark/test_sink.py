"""AmqpSink on a real local SparkSession against the real broker: every row arrives, retries
republish the same ids, failures fail the job with a reason, bad schemas are refused up front."""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest
from pyspark import TaskContext
from pyspark.cloudpickle import register_pickle_by_value
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from reliable_amqp import ConfigurationError
from reliable_amqp.spark import AmqpSink
from reliable_amqp.spark._sink import is_connect
from support.spark import Received, read_all, unique_name

pytestmark = [pytest.mark.spark, pytest.mark.broker]
# Workers cannot import this test module: ship its functions (the flaky UDFs) by value.
# (pyspark's vendored cloudpickle has no annotations, hence the ignore)
register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]

ATTEMPT = "x-reliable-amqp-attempt"


def numbered(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    """Rows ``n`` = 0..rows-1 (``spark.range`` partitions are contiguous and deterministic)."""
    return spark.range(0, rows, numPartitions=partitions).select(
        F.format_string("row %d ✓", "id").alias("body"),
        F.create_map(F.lit("n"), F.col("id").cast("string"), F.lit("kind"), F.lit("spark")).alias(
            "headers"
        ),
        F.col("id").cast("string").alias("correlation_id"),
        F.lit("text/plain").alias("content_type"),
    )


def row_number(message: Received) -> int:
    return int(message.body.decode().split()[1])


def position(message_id: str) -> tuple[int, int]:
    """(partition, position) from a derived id ``...:{partition}:{position}``."""
    *_, partition, pos = message_id.split(":")
    return int(partition), int(pos)


def test_100k_rows_in_4_partitions_arrive_intact(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("bulk"))
    summary = AmqpSink(amqp_url, routing_key=queue).write(numbered(spark, 100_000, 4))

    assert (summary.rows, summary.partitions) == (100_000, 4)
    received = read_all(amqp_url, queue, expected=100_000)
    assert len(received) == 100_000
    seen: set[int] = set()
    for m in received:
        n = row_number(m)
        seen.add(n)
        assert m.body == f"row {n} ✓".encode()
        assert {k: v for k, v in m.headers.items() if k != ATTEMPT} == {
            "n": str(n).encode() if isinstance(m.headers["n"], bytes) else str(n),
            "kind": b"spark" if isinstance(m.headers["kind"], bytes) else "spark",
        }
        assert m.properties.correlation_id == str(n)
        assert m.properties.content_type == "text/plain"
        assert m.properties.delivery_mode == 2
        # derived id: job, partition, position within the partition (25,000 rows each)
        assert m.message_id is not None and m.message_id.startswith(summary.job + ":")
        partition, pos = position(m.message_id)
        assert n == partition * 25_000 + pos
    assert seen == set(range(100_000))


@pytest.mark.spark_connect
def test_tasks_reuse_their_worker_s_publisher(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("reuse"))
    sink = AmqpSink(amqp_url, routing_key=queue, connection_name=unique_name("conn"))
    df = spark.range(0, 800, numPartitions=8).select(F.col("id").cast("string").alias("body"))
    first, second = sink.write(df), sink.write(df)
    assert first.rows == second.rows == 800
    # 16 tasks on 2 cores: each Python worker built its publisher once and kept it
    publishers = first.publishers | second.publishers
    assert 1 <= len(publishers) <= 4, publishers
    assert broker.count(queue) == 1600


ROWS, PARTS, FAIL_AT = 40_000, 2, 15_000
PER_PART = ROWS // PARTS


def _first_attempt_reached(n: int) -> bool:
    ctx = TaskContext.get()
    return ctx is not None and ctx.attemptNumber() == 0 and n % PER_PART == FAIL_AT


def _flaky_row(row: Any) -> Any:
    if _first_attempt_reached(int(row.body.split()[1])):
        raise RuntimeError("injected failure on the first attempt")
    return row


def via_foreach_partition(spark: SparkSession, sink: AmqpSink, df: DataFrame) -> None:
    if is_connect(df):  # no RDDs through Spark Connect: fail in a UDF upstream, as via_arrow
        _with_flaky_udf(spark, sink, df, lambda flaky: flaky.foreachPartition(sink))
        return
    # rdd.map runs in the same Python worker as the sink, so the rows before the failure were
    # handed to the publisher (and confirmed: the sink flushes before it re-raises).
    df.rdd.map(_flaky_row).foreachPartition(sink)


def _wait_until_queued(url: str, queue: str, count: int, timeout: float = 60) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        deadline = time.monotonic() + timeout
        channel = connection.channel()
        while time.monotonic() < deadline:
            if channel.queue_declare(queue, passive=True).method.message_count >= count:
                return
            time.sleep(0.1)
    finally:
        connection.close()


def via_arrow(spark: SparkSession, sink: AmqpSink, df: DataFrame) -> None:
    _with_flaky_udf(spark, sink, df, sink.write)


def _with_flaky_udf(
    spark: SparkSession, sink: AmqpSink, df: DataFrame, write: Callable[[DataFrame], object]
) -> None:
    # A Python UDF upstream of mapInArrow runs in its own worker. Before failing, it waits until
    # the sink has published rows of the first attempts, so the retry has something to duplicate.
    url, queue = sink.config.publisher.urls[0], sink.config.routing_key or ""

    def flaky(body: str) -> str:
        if _first_attempt_reached(int(body.split()[1])):
            _wait_until_queued(url, queue, FAIL_AT // 3)
            raise RuntimeError("injected failure on the first attempt")
        return body

    previous = spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert previous is not None  # Spark has a default for it
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    try:
        write(df.select(F.udf(flaky, "string", useArrow=False)("body").alias("body")))
    finally:
        spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", previous)


@pytest.mark.spark_connect
@pytest.mark.parametrize("write", [via_foreach_partition, via_arrow], ids=["rows", "arrow"])
def test_task_failing_mid_partition_is_retried_with_the_same_ids(
    spark: SparkSession,
    broker: Any,
    amqp_url: str,
    write: Callable[[SparkSession, AmqpSink, DataFrame], None],
) -> None:
    queue = broker.queue(unique_name("retry"))
    sink = AmqpSink(amqp_url, routing_key=queue)
    df = spark.range(0, ROWS, numPartitions=PARTS).select(
        F.format_string("row %d", "id").alias("body")
    )
    write(spark, sink, df)  # succeeds: the second attempt of each task goes through

    received = read_all(amqp_url, queue, expected=ROWS)
    by_id: dict[str, set[bytes]] = defaultdict(set)
    for m in received:
        assert m.message_id is not None
        by_id[m.message_id].add(m.body)
        partition, pos = position(m.message_id)
        assert row_number(m) == partition * PER_PART + pos  # the id names the row
    assert len(by_id) == ROWS, "every row arrived"
    assert all(len(bodies) == 1 for bodies in by_id.values()), "one id, one row"
    duplicates = len(received) - ROWS
    assert duplicates > 0, "the failed first attempts had published rows before failing"
    assert duplicates <= PARTS * (FAIL_AT + 1)
    # the duplicates are rows the first attempts reached before the injected failure
    counts: dict[str, int] = defaultdict(int)
    for m in received:
        counts[m.message_id or ""] += 1
    assert all(position(i)[1] <= FAIL_AT for i, c in counts.items() if c > 1)


@pytest.mark.spark_connect
def test_nacked_partition_fails_the_job_naming_how_many_and_why(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(
        unique_name("full"), **{"x-max-length": 10, "x-overflow": "reject-publish"}
    )
    sink = AmqpSink(
        amqp_url,
        routing_key=queue,
        delivery_timeout=5,
        nack_policy={"max_attempts": 2, "initial_delay": 0.05, "max_delay": 0.1, "jitter": 0},
    )
    df = spark.range(0, 1000, numPartitions=2).select(F.col("id").cast("string").alias("body"))
    with pytest.raises(Exception) as info:
        sink.write(df)
    text = str(info.value)
    found = re.search(r"(\d+) of 500 rows of partition \d were not confirmed by the broker", text)
    assert found, text[-3000:]
    assert 490 <= int(found.group(1)) <= 500
    assert "MessageNacked" in text and "x-overflow=reject-publish" in text
    assert broker.count(queue) == 10

    # Unroutable rows (mandatory is the sink's default) fail the same way, not silently.
    nowhere = AmqpSink(amqp_url, routing_key=unique_name("no-such-queue"))
    with pytest.raises(Exception) as info:
        nowhere.write(spark.range(0, 10, numPartitions=1).select(F.lit("x").alias("body")))
    assert "10 of 10 rows of partition 0 were not confirmed by the broker: " in str(info.value)
    assert "10 x MessageReturned (312 NO_ROUTE)" in str(info.value)


@pytest.mark.spark_connect
def test_properties_and_json_bodies_through_both_paths(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("props"))
    df = spark.range(0, 6, numPartitions=2).select(
        F.struct(F.col("id").alias("n"), F.lit("x").alias("s")).alias("body"),
        F.format_string("id-%d", "id").alias("message_id"),
        (F.col("id") % 3).cast("byte").alias("priority"),
        F.lit(60_000).alias("expiration"),
        F.lit("2024-01-02 03:04:05").cast("timestamp").alias("timestamp"),
        F.lit("app").alias("app_id"),
        F.create_map(F.lit("count"), F.col("id")).alias("headers"),
    )
    sink = AmqpSink(amqp_url, routing_key=queue)
    sink.write(df, via="arrow")
    sink.write(df, via="rows")
    df.foreachPartition(sink)

    received = read_all(amqp_url, queue, expected=18)
    assert len(received) == 18
    for m in received:
        n = int((m.message_id or "").removeprefix("id-"))
        assert m.body == f'{{"n":{n},"s":"x"}}'.encode()
        p = m.properties
        assert (p.content_type, p.priority, p.expiration, p.app_id) == (
            "application/json",
            n % 3,
            "60000",
            "app",
        )
        assert p.timestamp == 1704164645
        assert m.headers["count"] == n


def _bad_frames(spark: SparkSession) -> Iterator[tuple[DataFrame, list[str]]]:
    body = F.lit("b").alias("body")
    yield (
        spark.range(3).select(body, F.lit("red").alias("colour")),
        ["unknown column 'colour'"],
    )
    yield (
        spark.range(3).select(body, F.lit("high").alias("priority")),
        ["column 'priority' (priority) has type string; expected an integer type"],
    )
    yield (
        spark.range(3).select(
            body, F.create_map(F.lit("k"), F.array(F.lit(1))).alias("headers"), F.col("id")
        ),
        ["column 'headers' (headers) has type map<string,array<int>>", "unknown column 'id'"],
    )
    yield (spark.range(3).select(F.col("id").cast("string").alias("payload")), ["no body column"])


@pytest.mark.spark_connect
def test_bad_columns_and_types_are_refused_before_anything_is_sent(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("bad"))
    sink = AmqpSink(amqp_url, routing_key=queue)
    for df, problems in _bad_frames(spark):
        with pytest.raises(ConfigurationError) as info:
            sink.write(df)
        for problem in problems:
            assert problem in str(info.value)
        assert "nothing was sent" in str(info.value)
    unknown, _ = next(_bad_frames(spark))
    with pytest.raises(Exception, match="unknown column 'colour'"):
        unknown.foreachPartition(sink)  # checked on each partition's first row
    with pytest.raises(Exception, match="unknown column 'colour'"):
        unknown.write.format("amqp").mode("append").option("url", amqp_url).option(
            "routing_key", queue
        ).save()
    no_key = spark.range(3).select(F.lit("b").alias("body"))
    with pytest.raises(ConfigurationError, match="no routing key"):
        AmqpSink(amqp_url).write(no_key)
    assert broker.count(queue) == 0
