"""Spark benchmark rows: the sink (Arrow batches and Row objects) against the Publisher alone.

    python benchmarks/rows_spark.py                  # 200,000 rows, 256 B bodies, 2 partitions
    python benchmarks/rows_spark.py --repeat 3       # best of three runs of each row

In one run, on the local broker ($AMQP_URL), each row publishes the same 200,000 persistent,
mandatory messages (256 B bodies, derived message ids) to a durable queue:

- ``reliable_amqp.Publisher alone``: one process, ``publish()`` in a loop, then ``flush()``;
- ``spark sink (arrow)``: ``AmqpSink.write(df)``, 2 partitions (``local[2]``), rows handed to
  Python as Arrow record batches (``mapInArrow``);
- ``spark sink (rows)``: the same through ``Row`` objects (``df.rdd.mapPartitions``), which is
  also what ``df.foreachPartition(sink)`` does.

The DataFrame is cached and both sink paths are warmed up first (Python workers started,
publishers connected), so the rows compare steady-state throughput; each sink row is timed on
the driver from job submission to the last confirm. The queue is purged between rows, untimed.

Each sink row also carries ``convert_rate``: rows/s of the same job turning rows into message
parts without publishing (Spark to Python, then the column mapping): the part of the cost where
Arrow batches and Row objects differ.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import pika

from reliable_amqp import Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ROWS = 200_000
BODY_BYTES = 256
PARTITIONS = 2
PUBLISHER_ROW = "reliable_amqp.Publisher alone (1 process)"
ARROW_ROW = "spark sink (arrow)"
ROWS_ROW = "spark sink (rows)"

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


def _row(name: str, count: int, seconds: float, **extra: Any) -> Row:
    return {"name": name, "msgs": count, "seconds": seconds, "rate": count / seconds, **extra}


def _publisher_alone(url: str, queue: str, count: int) -> float:
    body = b"x" * BODY_BYTES
    job = uuid.uuid4().hex
    half = count // PARTITIONS
    with Publisher(url) as publisher:
        publisher.publish("", queue, body, mandatory=True).result(30)  # connected and warm
        started = time.perf_counter()
        for i in range(count):
            publisher.publish(
                "", queue, body, mandatory=True, message_id=f"{job}:{i // half}:{i % half}"
            )
        left = publisher.flush(300)
        seconds = time.perf_counter() - started
    if left:
        raise RuntimeError(f"{left} messages unconfirmed")
    return seconds


def rows(url: str = URL, count: int = ROWS, repeat: int = 1) -> list[Row]:
    """Benchmark rows for the Publisher alone and the Spark sink (Arrow and Row paths).

    Every row is the best of ``repeat`` runs; sink rows carry ``vs_publisher``, their rate over
    the standalone Publisher's in this run.
    """
    from pyspark.sql import functions as F

    from reliable_amqp.spark import AmqpSink

    spark, owned = _session()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    queue = f"ra-bench-spark-{uuid.uuid4().hex[:10]}"
    channel.queue_declare(queue, durable=True)
    try:
        df = spark.range(0, count, numPartitions=PARTITIONS).select(
            F.expr(f"repeat('x', {BODY_BYTES})").cast("binary").alias("body")
        )
        df.cache().count()
        sink = AmqpSink(url, routing_key=queue)
        warm = df.limit(2000).repartition(PARTITIONS)
        for via in ("arrow", "rows"):
            sink.write(warm, via=via)
        channel.queue_purge(queue)

        def timed_sink(via: Literal["arrow", "rows"]) -> Callable[[], float]:
            def run() -> float:
                summary = sink.write(df, via=via)
                if summary.rows != count:
                    raise RuntimeError(f"sink confirmed {summary.rows} of {count} rows")
                return summary.seconds

            return run

        runs: list[tuple[str, Callable[[], float]]] = [
            (PUBLISHER_ROW, lambda: _publisher_alone(url, queue, count)),
            (ARROW_ROW, timed_sink("arrow")),
            (ROWS_ROW, timed_sink("rows")),
        ]
        best: dict[str, float] = {}
        for _ in range(repeat):
            for name, run in runs:
                seconds = run()
                _wait_for(channel, queue, count)
                best[name] = min(seconds, best.get(name, seconds))
        result = [
            _row(name, count, best[name], body_bytes=BODY_BYTES, partitions=PARTITIONS)
            for name, _ in runs
        ]
        publisher_rate = result[0]["rate"]
        converted = _conversion_rates(sink, df, count, repeat)
        for row, via in zip(result[1:], ("arrow", "rows"), strict=True):
            row["vs_publisher"] = row["rate"] / publisher_rate
            row["convert_rate"] = converted[via]
        return result
    finally:
        channel.queue_delete(queue)
        connection.close()
        if owned:
            spark.stop()


def _conversion_rates(sink: Any, df: Any, count: int, repeat: int) -> dict[str, float]:
    """Rows/s from Spark to message parts, without publishing, for both paths (best of runs)."""
    import pyarrow as pa

    from reliable_amqp.spark._publish import chunk_rows

    config = sink.config
    plan = sink.check(df.schema)

    def arrow_parts(batches: Any) -> Any:
        n = sum(plan.chunk_from_arrow(batch).size for batch in batches)
        yield pa.record_batch([pa.array([n], pa.int64())], names=["n"])

    def row_parts(rows: Any) -> Any:
        yield sum(chunk.size for chunk in chunk_rows(plan, config, rows))

    jobs: dict[str, Callable[[], int]] = {
        "arrow": lambda: sum(r.n for r in df.mapInArrow(arrow_parts, "n long").collect()),
        "rows": lambda: sum(df.rdd.mapPartitions(row_parts).collect()),
    }
    best: dict[str, float] = {}
    for _ in range(max(repeat, 2)):  # the first run of each also starts its workers
        for via, job in jobs.items():
            started = time.perf_counter()
            if job() != count:
                raise RuntimeError(f"{via}: conversion lost rows")
            best[via] = max(count / (time.perf_counter() - started), best.get(via, 0.0))
    return best


def table(result: list[Row]) -> str:
    """The rows as a text table with each rate's ratio to the standalone Publisher."""
    base = next(r["rate"] for r in result if r["name"] == PUBLISHER_ROW)
    lines = [
        f"{'row':<44} {'seconds':>8} {'rows/s':>10} {'vs Publisher':>13} "
        f"{'convert only rows/s':>20}"
    ]
    for r in result:
        convert = f"{r['convert_rate']:>20,.0f}" if "convert_rate" in r else f"{'-':>20}"
        lines.append(
            f"{r['name']:<44} {r['seconds']:>8.2f} {r['rate']:>10,.0f} "
            f"{r['rate'] / base:>12.2f}x {convert}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--repeat", type=int, default=1, help="best of this many runs per row")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    result = rows(args.url, args.rows, args.repeat)
    print(
        f"\n{args.rows:,} rows of {BODY_BYTES} B, {PARTITIONS} partitions "
        f"(persistent, mandatory, confirmed), best of {args.repeat}:"
    )
    print(table(result))
    arrow = next(r for r in result if r["name"] == ARROW_ROW)
    print(f"\nsink (arrow) / Publisher alone: {arrow['vs_publisher']:.2f}x (target >= 0.7x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
