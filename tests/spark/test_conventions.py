"""Spark's own conventions: the options Spark adds to a writer's (each accepted and ignored),
Kafka's ``value`` column as the body, and one log line per event whatever the application's
logging configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from reliable_amqp import ConfigurationError
from reliable_amqp.spark import AmqpSink, SinkConfig
from reliable_amqp.spark._publish import SPARK_OPTIONS
from support.broker import AMQP_DEFAULT_PORT
from support.spark import read_all, unique_name

URL = f"amqp://guest:guest@127.0.0.1:{AMQP_DEFAULT_PORT}/%2F"

# What PySpark 4.3 passes to a Python data source besides the user's options, found by writing
# through a probe data source that records them (DataFrameWriter.save(path),
# DataStreamWriter.queryName/start(path, queryName=...)/option("checkpointLocation")), plus the
# keys DataSourceUtils reserves for partitionBy/clusterBy (Spark refuses those for Python data
# sources before asking for a writer, but they are Spark's, never a publisher option).
SPARK_ADDED = {
    "path": "/tmp/out",
    "paths": '["/tmp/a","/tmp/b"]',
    "checkpointlocation": "/tmp/checkpoint",
    "queryname": "orders",
    "__partition_columns": '["region"]',
    "__clustering_columns": '[["region"]]',
}

_CAMEL = {"checkpointlocation": "checkpointLocation", "queryname": "queryName"}


def test_every_option_spark_adds_is_known() -> None:
    assert set(SPARK_ADDED) == set(SPARK_OPTIONS)


@pytest.mark.parametrize("name", sorted(SPARK_ADDED))
def test_a_spark_added_option_is_accepted_and_ignored(name: str) -> None:
    plain = SinkConfig.from_strings({"url": URL, "routing_key": "q"})
    # as Spark hands them over (lower-cased) and as written in the caller's code (camel case)
    for key in {name, _CAMEL.get(name, name)}:
        config = SinkConfig.from_strings({"url": URL, "routing_key": "q", key: SPARK_ADDED[name]})
        assert config == plain
        assert AmqpSink.from_options({"url": URL, key: SPARK_ADDED[name]}).config.publisher == (
            plain.publisher
        )


def test_unknown_options_are_still_refused() -> None:
    with pytest.raises(ConfigurationError, match="unknown publisher option 'queryname2'"):
        SinkConfig.from_strings({"url": URL, "queryname2": "x"})


@pytest.mark.spark
@pytest.mark.broker
def test_batch_save_with_a_path_delivers(spark: SparkSession, broker: Any, amqp_url: str) -> None:
    queue = broker.queue(unique_name("path"))
    df = spark.range(0, 300, numPartitions=2).select(F.col("id").cast("string").alias("body"))
    df.write.format("amqp").mode("append").option("url", amqp_url).option(
        "routing_key", queue
    ).save("/tmp/ignored-by-amqp")
    received = read_all(amqp_url, queue, expected=300)
    assert sorted(int(m.body) for m in received) == list(range(300))


@pytest.mark.spark
@pytest.mark.broker
@pytest.mark.spark_connect
def test_write_stream_with_query_name_path_and_checkpoint_delivers(
    spark: SparkSession, broker: Any, amqp_url: str, tmp_path: Path
) -> None:
    queue = broker.queue(unique_name("named"))
    source = tmp_path / "in"
    source.mkdir()
    for f in range(2):
        lines = [json.dumps({"value": f"file {f} line {i}"}) for i in range(100)]
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    stream = (
        spark.readStream.schema("value string").option("maxFilesPerTrigger", 1).json(str(source))
    )
    query = (
        stream.writeStream.format("amqp")
        .queryName(f"orders_{os.getpid()}")  # Spark passes it to the sink's options
        .option("url", amqp_url)
        .option("routing_key", queue)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start(str(tmp_path / "out"))  # a path, which Spark passes as well
    )
    query.awaitTermination(120)
    assert query.exception() is None
    received = read_all(amqp_url, queue, expected=200)
    assert sorted(m.body for m in received) == sorted(
        f"file {f} line {i}".encode() for f in range(2) for i in range(100)
    )
    assert all((m.message_id or "").startswith(f"{query.id}:b") for m in received)


# --- Kafka's columns --------------------------------------------------------------------------


def test_value_is_the_body_when_there_is_no_body_column() -> None:
    config = SinkConfig.from_strings({"url": URL, "routing_key": "q"})
    schema = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
    with pytest.raises(ConfigurationError) as refused:
        config.plan(schema)
    assert "unknown column 'key' (Kafka's key: alias it routing_key" in str(refused.value)
    plan = config.plan(StructType([StructField("value", BinaryType())]))
    body = plan.role("body")
    assert body is not None and body.name == "value"
    # with a body column too, value is just an unknown column; a renamed body column wins
    both = StructType([StructField("body", StringType()), StructField("value", StringType())])
    with pytest.raises(ConfigurationError, match="unknown column 'value'"):
        config.plan(both)
    renamed = SinkConfig.from_strings({"url": URL, "routing_key": "q", "body_column": "payload"})
    with pytest.raises(ConfigurationError, match="no body column 'payload' \\(set body_column"):
        renamed.plan(StructType([StructField("value", StringType())]))


def test_kafka_style_headers_and_topic_are_refused_with_the_way_to_map_them() -> None:
    config = SinkConfig.from_strings({"url": URL})
    schema = StructType.fromJson(
        {
            "type": "struct",
            "fields": [
                {"name": "topic", "type": "string", "nullable": True, "metadata": {}},
                {"name": "value", "type": "string", "nullable": True, "metadata": {}},
                {
                    "name": "headers",
                    "type": {
                        "type": "array",
                        "elementType": {
                            "type": "struct",
                            "fields": [
                                {"name": "key", "type": "string", "nullable": True, "metadata": {}},
                                {
                                    "name": "value",
                                    "type": "binary",
                                    "nullable": True,
                                    "metadata": {},
                                },
                            ],
                        },
                        "containsNull": True,
                    },
                    "nullable": True,
                    "metadata": {},
                },
            ],
        }
    )
    with pytest.raises(ConfigurationError) as refused:
        config.plan(schema)
    text = str(refused.value)
    assert "unknown column 'topic' (Kafka's topic: alias it routing_key" in text
    assert "F.map_from_entries('headers')" in text


@pytest.mark.spark
@pytest.mark.broker
def test_a_kafka_shaped_dataframe_publishes_value_as_the_body(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("kafka"))
    kafka = spark.range(0, 500, numPartitions=2).select(
        F.col("id").cast("string").alias("key"),
        F.format_string("payload %d", "id").cast("binary").alias("value"),
        F.array(F.struct(F.lit("source").alias("key"), F.lit(b"spark").alias("value"))).alias(
            "headers"
        ),
    )
    # the mapping docs/spark.md gives: key -> message_id, headers -> a map
    df = kafka.select(
        F.col("key").alias("message_id"),
        "value",
        F.map_from_entries("headers").alias("headers"),
    )
    sink = AmqpSink(amqp_url, routing_key=queue)
    assert sink.write(df).rows == 500
    df.foreachPartition(sink)  # the Row path finds value too
    df.write.format("amqp").mode("append").option("url", amqp_url).option(
        "routing_key", queue
    ).save()
    received = read_all(amqp_url, queue, expected=1500)
    assert len(received) == 1500
    for m in received:
        assert m.body == f"payload {m.message_id}".encode()
        assert m.headers["source"] == b"spark"


# --- logging ----------------------------------------------------------------------------------

_LOG_SCRIPT = """
import logging, sys
mode = sys.argv[1]
if mode == "before":
    logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s")
from reliable_amqp.spark._logging import driver_log, log
from reliable_amqp.spark import _publish  # noqa: F401  (RELIABLE_AMQP_SPARK_LOG is read here)
if mode == "after":
    logging.basicConfig(level=logging.INFO, format="APP %(name)s %(message)s")
if mode == "warning":
    logging.basicConfig(level=logging.WARNING, format="APP %(name)s %(message)s")
log.info("event one")
driver_log().info("event two")
log.warning("event three")
"""


@pytest.mark.parametrize("env", ["INFO", ""])
@pytest.mark.parametrize("mode", ["none", "before", "after", "warning"])
def test_one_line_per_event_whatever_the_logging_configuration(
    mode: str, env: str, tmp_path: Path
) -> None:
    script = tmp_path / "log_probe.py"
    script.write_text(textwrap.dedent(_LOG_SCRIPT))
    environ = {k: v for k, v in os.environ.items() if k != "RELIABLE_AMQP_SPARK_LOG"}
    if env:
        environ["RELIABLE_AMQP_SPARK_LOG"] = env
    done = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
        check=True,
    )
    lines = [line for line in done.stderr.splitlines() if "event " in line]
    counts = {event: sum(event in line for line in lines) for event in ("one", "two", "three")}
    print(mode, env or "-", lines)
    # never twice; a WARNING always shows; INFO shows unless the application asked for WARNING
    # (RELIABLE_AMQP_SPARK_LOG=INFO asks for it explicitly), or nobody asked for it at all
    assert all(n <= 1 for n in counts.values()), lines
    assert counts["three"] == 1
    shown_info = env == "INFO" or mode in ("before", "after")
    assert counts["one"] == (1 if shown_info else 0)
    # driver_log prints INFO when nothing is configured at its first use
    assert counts["two"] == (1 if shown_info or mode == "none" else 0)
