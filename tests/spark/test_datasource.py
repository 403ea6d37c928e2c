"""The ``amqp`` data source (batch and streaming) and ``foreachBatch(sink.for_batch)``, on a real
SparkSession and broker; options arrive as strings."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from reliable_amqp.spark import AmqpSink
from support.spark import read_all, start_query, unique_name

pytestmark = [pytest.mark.spark, pytest.mark.broker]


@pytest.mark.spark_connect
def test_batch_write_with_string_options(spark: SparkSession, broker: Any, amqp_url: str) -> None:
    queue = broker.queue(unique_name("ds"))
    prefix = unique_name("job")
    df = spark.range(0, 5000, numPartitions=2).select(
        F.format_string("event %d", "id").alias("body"),
        F.lit(queue).alias("routing_key"),
    )
    (
        df.write.format("amqp")
        .mode("append")
        .option("url", amqp_url)
        .option("id_prefix", prefix)
        .option("max_in_flight", "500")
        .option("delivery_timeout", "30")
        .option("nack_policy.max_attempts", "3")
        .option("nack_policy.initial_delay", "0.05")
        .option("connection_name", "spark-ds-test")
        .save()
    )
    received = read_all(amqp_url, queue, expected=5000)
    assert len(received) == 5000
    ids = {m.message_id for m in received}
    assert ids == {f"{prefix}:{p}:{i}" for p in (0, 1) for i in range(2500)}
    for m in received:
        _, p, i = (m.message_id or "").rsplit(":", 2)
        assert m.body == f"event {int(p) * 2500 + int(i)}".encode()


@pytest.mark.spark_connect
def test_data_source_refuses_overwrite_and_unknown_options(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("dsbad"))
    df = spark.range(3).select(F.col("id").cast("string").alias("body"))

    def writer() -> Any:  # DataFrameWriter.mode() mutates: a fresh writer per attempt
        return df.write.format("amqp").option("url", amqp_url).option("routing_key", queue)

    with pytest.raises(Exception, match=r'mode\("append"\)'):
        writer().mode("overwrite").save()
    with pytest.raises(Exception, match="ErrorIfExists"):
        writer().save()  # Spark itself refuses its default mode for Python data sources
    with pytest.raises(Exception, match="unknown publisher option 'max_inflight'"):
        writer().mode("append").option("max_inflight", "5").save()
    with pytest.raises(Exception, match="max_attempts must be a whole number"):
        writer().mode("append").option("nack_policy.max_attempts", "lots").save()
    with pytest.raises(Exception, match=r'needs \.option\("url"'):
        df.write.format("amqp").mode("append").option("routing_key", queue).save()
    assert broker.count(queue) == 0


def _json_files(directory: Path, files: int, rows: int, start: int = 0) -> None:
    directory.mkdir(exist_ok=True)
    for f in range(start, start + files):
        lines = [json.dumps({"body": f"file {f} line {i}"}) for i in range(rows)]
        (directory / f"part-{f:03d}.json").write_text("\n".join(lines) + "\n")


def _run_stream(spark: SparkSession, source: Path, checkpoint: Path, sink: Any) -> Any:
    stream = (
        spark.readStream.schema("body string").option("maxFilesPerTrigger", 1).json(str(source))
    )
    writer = stream.writeStream.option("checkpointLocation", str(checkpoint))
    query = start_query(sink(writer).trigger(availableNow=True).start)
    query.awaitTermination(120)
    assert query.exception() is None
    return query


@pytest.mark.spark_connect
def test_streaming_query_writes_micro_batches_and_resumes_from_its_checkpoint(
    spark: SparkSession, broker: Any, amqp_url: str, tmp_path: Path
) -> None:
    queue = broker.queue(unique_name("stream"))
    source, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    _json_files(source, files=3, rows=200)

    def amqp(writer: Any) -> Any:
        return (
            writer.format("amqp")
            .option("url", amqp_url)
            .option("routing_key", queue)
            .option("delivery_timeout", "30")
        )

    query = _run_stream(spark, source, checkpoint, amqp)
    received = read_all(amqp_url, queue, expected=600)
    assert len(received) == 600
    batches = Counter((m.message_id or "").split(":")[1] for m in received)
    assert batches == {"b0": 200, "b1": 200, "b2": 200}  # three micro-batches, one file each
    assert all((m.message_id or "").startswith(f"{query.id}:b") for m in received)
    assert len({m.message_id for m in received}) == 600

    # Restarted on the same checkpoint, the query only writes what is new.
    _json_files(source, files=1, rows=50, start=3)
    again = _run_stream(spark, source, checkpoint, amqp)
    assert again.id == query.id
    received = read_all(amqp_url, queue, expected=50)
    assert len(received) == 50
    assert {(m.message_id or "").split(":")[1] for m in received} == {"b3"}
    assert {m.body for m in received} == {f"file 3 line {i}".encode() for i in range(50)}


@pytest.mark.spark_connect
def test_foreach_batch_ids_carry_query_and_batch(
    spark: SparkSession, broker: Any, amqp_url: str, tmp_path: Path
) -> None:
    queue = broker.queue(unique_name("fb"))
    source = tmp_path / "in"
    _json_files(source, files=3, rows=100)
    # Through Connect, foreachBatch runs on the server without a SparkContext: the query id is
    # out of reach there, so ids that must survive a restart need id_prefix (docs/spark.md).
    connect = type(spark).__module__.startswith("pyspark.sql.connect.")
    prefix = unique_name("fbjob") if connect else None
    sink = AmqpSink(amqp_url, routing_key=queue, id_prefix=prefix)
    query = _run_stream(
        spark, source, tmp_path / "checkpoint", lambda w: w.foreachBatch(sink.for_batch)
    )
    received = read_all(amqp_url, queue, expected=300)
    assert len(received) == 300
    ids = {m.message_id for m in received}
    assert len(ids) == 300
    assert {i.split(":")[1] for i in ids if i} == {"b0", "b1", "b2"}
    assert all(i and i.startswith(f"{prefix or query.id}:b") for i in ids)
