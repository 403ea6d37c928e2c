"""Spark benchmark rows: the sink's ways in against the standalone Publisher, in one run.

    python benchmarks/rows_spark.py                  # 200,000 rows of 100 B and of 1 KiB
    python benchmarks/rows_spark.py --repeat 3       # best of three runs of each row
    python benchmarks/rows_spark.py --sizes 100 --rows 50000

For each body size, on the local broker ($AMQP_URL), each row publishes the same number of
persistent, mandatory messages to one durable queue:

- ``Publisher.publish_many alone``: one process, ``publish_many()`` in calls of 10,000 bodies
  (Spark's Arrow batch size), then ``flush()``: the standalone figure the sink is compared to;
- ``sink.write (arrow)``: ``AmqpSink.write(df)``, 2 partitions (``local[2]``), rows handed to
  Python as Arrow record batches (``mapInArrow``);
- ``foreachPartition``: ``df.foreachPartition(sink)``, rows handed to Python as ``Row`` objects.

The DataFrame is cached and both sink paths are warmed up first (Python workers started,
publishers connected), so the rows compare steady-state throughput; each sink row is timed on
the driver from job submission to the last confirm. The queue is checked and purged between
rows, untimed. Targets (docs/spark.md): sink.write >= 0.85x, foreachPartition >= 0.7x.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pika

from reliable_amqp import Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ROWS = 200_000
SIZES = (100, 1024)
PARTITIONS = 2
BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch's default
PUBLISHER_ROW = "Publisher.publish_many alone (1 process)"
ARROW_ROW = "sink.write (arrow)"
FOREACH_ROW = "df.foreachPartition(sink)"
TARGETS = {ARROW_ROW: 0.85, FOREACH_ROW: 0.7}

Row = dict[str, Any]


def _session() -> tuple[Any, bool]:
    """The active SparkSession, or a new lean local one (and whether we own it)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    spark = (
        SparkSession.builder.master(f"local[{PARTITIONS}]")
        .appName("reliable-amqp benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(PARTITIONS))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


def _wait_for(channel: Any, queue: str, count: int) -> None:
    """Untimed check that the broker holds every message, then an empty queue for the next row."""
    deadline = time.monotonic() + 60
    while channel.queue_declare(queue, passive=True).method.message_count < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"queue {queue} did not receive {count} messages")
        time.sleep(0.1)
    channel.queue_purge(queue)


def _publisher_alone(url: str, queue: str, count: int, size: int) -> float:
    body = b"x" * size
    with Publisher(url) as publisher:
        publisher.publish("", queue, body, mandatory=True).result(30)  # connected and warm
        started = time.perf_counter()
        for start in range(0, count, BATCH):
            publisher.publish_many("", queue, [body] * min(BATCH, count - start), mandatory=True)
        left = publisher.flush(300)
        seconds = time.perf_counter() - started
    if left:
        raise RuntimeError(f"{left} messages unconfirmed")
    return seconds


def rows(
    url: str = URL, count: int = ROWS, repeat: int = 1, sizes: tuple[int, ...] = SIZES
) -> list[Row]:
    """Benchmark rows for the standalone Publisher and the sink's ways in, per body size.

    Every row is the best of ``repeat`` runs; sink rows carry ``vs_publisher``, their rate over
    the standalone ``publish_many`` of the same size in this run.
    """
    from pyspark.sql import functions as F

    from reliable_amqp.spark import AmqpSink

    spark, owned = _session()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    queue = f"ra-bench-spark-{uuid.uuid4().hex[:10]}"
    channel.queue_declare(queue, durable=True)
    result: list[Row] = []
    try:
        sink = AmqpSink(url, routing_key=queue)
        for size in sizes:
            df = spark.range(0, count, numPartitions=PARTITIONS).select(
                F.expr(f"repeat('x', {size})").cast("binary").alias("body")
            )
            df.cache().count()
            warm = df.limit(2000).repartition(PARTITIONS)
            sink.write(warm)
            warm.foreachPartition(sink)
            channel.queue_purge(queue)

            def write_arrow(df: Any = df) -> float:
                summary = sink.write(df)
                if summary.rows != count:
                    raise RuntimeError(f"sink confirmed {summary.rows} of {count} rows")
                return summary.seconds

            def foreach(df: Any = df) -> float:
                started = time.perf_counter()
                df.foreachPartition(sink)
                return time.perf_counter() - started

            def alone(size: int = size) -> float:
                return _publisher_alone(url, queue, count, size)

            runs: list[tuple[str, Callable[[], float]]] = [
                (PUBLISHER_ROW, alone),
                (ARROW_ROW, write_arrow),
                (FOREACH_ROW, foreach),
            ]
            best: dict[str, float] = {}
            for _ in range(repeat):
                for name, run in runs:
                    seconds = run()
                    _wait_for(channel, queue, count)
                    best[name] = min(seconds, best.get(name, seconds))
            base = count / best[PUBLISHER_ROW]
            for name, _ in runs:
                rate = count / best[name]
                result.append(
                    {
                        "name": f"{name}, {size} B",
                        "way": name,
                        "msgs": count,
                        "seconds": best[name],
                        "rate": rate,
                        "body_bytes": size,
                        "partitions": PARTITIONS,
                        "vs_publisher": rate / base,
                    }
                )
            df.unpersist()
        return result
    finally:
        channel.queue_delete(queue)
        connection.close()
        if owned:
            spark.stop()


def table(result: list[Row]) -> str:
    """The rows as a text table with each rate's ratio to the standalone publish_many."""
    lines = [f"{'row':<44} {'body':>6} {'seconds':>8} {'rows/s':>10} {'vs publish_many':>16}"]
    for r in result:
        target = TARGETS.get(r["way"])
        verdict = "" if target is None else f"  (target {target:.2f}x)"
        lines.append(
            f"{r['way']:<44} {r['body_bytes']:>4} B {r['seconds']:>8.2f} {r['rate']:>10,.0f} "
            f"{r['vs_publisher']:>15.2f}x{verdict}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--repeat", type=int, default=1, help="best of this many runs per row")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="body sizes, bytes")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    result = rows(args.url, args.rows, args.repeat, sizes)
    print(
        f"\n{args.rows:,} rows per row, {PARTITIONS} partitions (persistent, mandatory, "
        f"confirmed), best of {args.repeat}:"
    )
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
