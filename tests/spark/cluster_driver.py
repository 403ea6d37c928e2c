"""A Spark application run against the standalone cluster of tests/support/spark_cluster.py, as
users run one: its own driver process (``python cluster_driver.py MODE CONFIG_JSON``), executors on
the cluster's workers. tests/spark/test_cluster.py starts it, kills parts of the cluster while it
runs, and checks the queue by message id. The last line it prints is its result, as JSON.

Modes:

- ``ways``: the same rows through ``df.foreachPartition(sink)``, ``sink.write(df)`` and
  ``df.write.format("amqp")``, each to its own queue;
- ``write``: one ``sink.write(df)`` (the tests kill an executor or a worker meanwhile);
- ``stream``: a streaming query (``writeStream.format("amqp").queryName(...)``) over JSON
  files, stopped once ``stop_at`` messages are in the queue (mid-batch), then restarted from
  its checkpoint until every file is written.

Rows are ``spark.range`` numbers ``n``; the body is ``row {n}``.

``serve`` runs one application for several of those: it reads one command a line on stdin (the
config of a mode, with ``"mode"``) and prints each result as a JSON line, until stdin ends. The
tests share one application this way (issue 33: each application costs a driver JVM and its
executors, most of a test's time).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pika
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from reliable_amqp.spark import AmqpSink, register

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # support.*
from support.jvm import SPARK_JVM_OPTIONS


def session(master: str, name: str) -> SparkSession:
    """A driver on this machine for the cluster at ``master`` (loopback, 2 executors)."""
    spark = (
        SparkSession.builder.master(master)
        .appName(name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.executor.cores", "1")
        .config("spark.driver.extraJavaOptions", SPARK_JVM_OPTIONS)  # (its env has none)
        .config("spark.executor.extraJavaOptions", SPARK_JVM_OPTIONS)
        .config("spark.cores.max", "2")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.task.maxFailures", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def numbered(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    """``row {n}`` bodies, n = 0..rows-1 in contiguous partitions."""
    return spark.range(0, rows, numPartitions=partitions).select(
        F.format_string("row %d", "id").alias("body")
    )


class QueueDepth:
    """Messages in a queue now (a passive declare on one connection, so polls are quick)."""

    def __init__(self, url: str, queue: str) -> None:
        self.queue = queue
        self.connection = pika.BlockingConnection(pika.URLParameters(url))
        self.channel = self.connection.channel()

    def __call__(self) -> int:
        ok = self.channel.queue_declare(self.queue, passive=True)
        return int(ok.method.message_count)

    def close(self) -> None:
        self.connection.close()


def ways(spark: SparkSession, c: dict[str, Any]) -> dict[str, Any]:
    """The three ways in, each to its queue, with the id prefix the test gave it."""
    df = numbered(spark, c["rows"], c["partitions"])
    queues, prefixes = c["queues"], c["prefixes"]
    out: dict[str, Any] = {}
    started = time.perf_counter()
    df.foreachPartition(
        AmqpSink(c["url"], routing_key=queues["foreach"], id_prefix=prefixes["foreach"])
    )
    out["foreach"] = {"seconds": time.perf_counter() - started}
    summary = AmqpSink(c["url"], routing_key=queues["write"], id_prefix=prefixes["write"]).write(df)
    out["write"] = {"seconds": summary.seconds, "rows": summary.rows}
    started = time.perf_counter()
    (
        df.write.format("amqp")
        .mode("append")
        .option("url", c["url"])
        .option("routing_key", queues["format"])
        .option("id_prefix", prefixes["format"])
        .save()
    )
    out["format"] = {"seconds": time.perf_counter() - started}
    return out


def write(spark: SparkSession, c: dict[str, Any]) -> dict[str, Any]:
    """One sink.write of ``rows`` rows in ``partitions`` partitions."""
    df = numbered(spark, c["rows"], c["partitions"])
    sink = AmqpSink(c["url"], routing_key=c["queue"], id_prefix=c["prefix"])
    summary = sink.write(df)
    return {"rows": summary.rows, "partitions": summary.partitions, "seconds": summary.seconds}


def stream(spark: SparkSession, c: dict[str, Any]) -> dict[str, Any]:
    """Start the query, stop it mid-batch, restart it from its checkpoint to the end."""

    def start(available_now: bool) -> Any:
        rows = (
            spark.readStream.schema("n long")
            .option("maxFilesPerTrigger", 1)
            .json(c["source"])
            .select(F.format_string("row %d", "n").alias("body"))
        )
        writer = (
            rows.writeStream.format("amqp")
            .queryName(c["query_name"])
            .option("url", c["url"])
            .option("routing_key", c["queue"])
            .option("checkpointLocation", c["checkpoint"])
        )
        if available_now:
            writer = writer.trigger(availableNow=True)
        return writer.start()

    query = start(available_now=False)
    depth_now = QueueDepth(c["url"], c["queue"])
    try:
        deadline = time.monotonic() + 180
        while (depth := depth_now()) < c["stop_at"]:
            if query.exception() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the query stalled at {depth} messages: {query.exception()}")
            time.sleep(0.01)
        progress = query.lastProgress
        query.stop()
        at_stop = settled = depth_now()
        # what still reaches the queue after stop() returned: until the depth holds still for
        # half a second (at most ``settle`` seconds), not a fixed wait
        deadline, still_since = time.monotonic() + c.get("settle", 4.0), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - still_since < 0.5:
            time.sleep(0.05)
            if (now := depth_now()) != settled:
                settled, still_since = now, time.monotonic()
    finally:
        depth_now.close()
    again = start(available_now=True)
    again.awaitTermination(240)
    if again.exception() is not None:
        raise RuntimeError(f"the restarted query failed: {again.exception()}")
    return {
        "query_id": str(query.id),
        "restarted_id": str(again.id),
        "stopped_at_depth": depth,
        "depth_when_stop_returned": at_stop,
        "depth_settled": settled,
        "last_batch_before_stop": None if progress is None else progress.get("batchId"),
    }


def read_stream(spark: SparkSession, c: dict[str, Any]) -> dict[str, Any]:
    """Read a stream (``spark.readStream.format("amqp")``) into a parquet file sink with a
    checkpoint, up to the stream's end as it is now (``availableNow``)."""
    query = (
        spark.readStream.format("amqp")
        .option("url", c["url"])
        .option("stream", c["stream"])
        .option("startingOffsets", "earliest")
        .option("maxMessagesPerTrigger", str(c["per_trigger"]))
        .option("minPartitions", "2")
        .load()
        .select("message_id", "offset")
        .writeStream.format("parquet")
        .option("path", c["output"])
        .option("checkpointLocation", c["checkpoint"])
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    if query.exception() is not None:
        raise RuntimeError(f"the query failed: {query.exception()}")
    return {"rows": sum(p["numInputRows"] for p in query.recentProgress)}


MODES = {"ways": ways, "write": write, "stream": stream, "read_stream": read_stream}


def serve(spark: SparkSession) -> None:
    """Run the commands read from stdin, one a line, printing each result as a JSON line."""
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        try:
            result = {"ok": True, **MODES[command["mode"]](spark, command)}
        except Exception as exc:  # the test reads the failure; the application goes on
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)


def main() -> int:
    mode, config = sys.argv[1], json.loads(sys.argv[2])
    spark = session(config["master"], f"reliable-amqp-cluster-{mode}")
    try:
        if mode == "serve":
            serve(spark)
            return 0
        result = MODES[mode](spark, config)
    finally:
        spark.stop()
    print(json.dumps({"ok": True, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
