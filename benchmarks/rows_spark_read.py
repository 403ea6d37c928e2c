"""Spark stream-read benchmark: ``spark.read.format("amqp")`` against one pika consumer, one run.

    python benchmarks/rows_spark_read.py                     # 200,000 messages of 100 B
    python benchmarks/rows_spark_read.py --repeat 3          # best of three runs of each row
    python benchmarks/rows_spark_read.py --messages 50000 --size 1024 --partitions 2

One stream on the local broker ($AMQP_URL) is filled once (untimed), then read whole, from its
first offset to its end, by each row:

- ``pika consumer alone``: one process, one ``BlockingConnection``, ``basic.consume`` at
  ``x-stream-offset: first`` with prefetch 2000 and acks every 500 (``multiple``), until the
  last offset: the figure Spark is compared to (the issue's target: Spark at least as fast);
- ``spark.read amqp``: ``spark.read.format("amqp")`` with ``minPartitions`` = the number of
  ``local[N]`` cores, every column materialised (``write.format("noop")``), timed on the driver
  from the job's submission to its end, on a warmed-up session (Python workers started).

Reported: messages per second for each row, and for Spark also per partition (each Spark task
reads one contiguous range with its own connection).
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
MESSAGES = 200_000
SIZE = 100
PARTITIONS = 2
PIKA_ROW = "pika consumer alone (1 process)"
SPARK_ROW = "spark.read.format('amqp')"

Row = dict[str, Any]


def _fill(url: str, stream: str, count: int, size: int) -> None:
    body = b"x" * size
    with Publisher(url, max_in_flight=10_000) as publisher:
        for start in range(0, count, 10_000):
            publisher.publish_many("", stream, [body] * min(10_000, count - start))
        if publisher.flush(600):
            raise RuntimeError("the stream was not filled")


def pika_alone(url: str, stream: str, count: int) -> float:
    """Seconds for one pika consumer to read the stream's ``count`` messages."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=2000)
        seen = [0]

        def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
            seen[0] += 1
            if seen[0] % 500 == 0:
                ch.basic_ack(method.delivery_tag, multiple=True)

        started = time.perf_counter()
        channel.basic_consume(stream, on_message, arguments={"x-stream-offset": "first"})
        while seen[0] < count:
            connection.process_data_events(0.1)
        seconds = time.perf_counter() - started
        channel._impl.close()  # (not cancel: pika would reject what is in flight; see _stream)
        while not channel.is_closed:
            connection.process_data_events(0.05)
        return seconds
    finally:
        connection.close()


def _session(partitions: int) -> tuple[Any, bool]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    spark = (
        SparkSession.builder.master(f"local[{partitions}]")
        .appName("reliable-amqp read benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark, True


def spark_read(spark: Any, url: str, stream: str, partitions: int, count: int) -> float:
    """Seconds for ``spark.read.format("amqp")`` to read (every column of) the whole stream."""
    df = (
        spark.read.format("amqp")
        .option("url", url)
        .option("stream", stream)
        .option("minPartitions", str(partitions))
        .load()
    )
    started = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    seconds = time.perf_counter() - started
    got = df.count()  # untimed check (reads again)
    if got != count:
        raise RuntimeError(f"spark read {got} of {count} messages")
    return seconds


def rows(
    url: str = URL,
    count: int = MESSAGES,
    size: int = SIZE,
    partitions: int = PARTITIONS,
    repeat: int = 1,
) -> list[Row]:
    """The two rows (best of ``repeat``); Spark's carries ``vs_pika`` and ``rate_per_partition``."""
    from reliable_amqp.spark import register

    spark, owned = _session(partitions)
    register(spark)
    stream = f"ra-bench-read-{uuid.uuid4().hex[:10]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    try:
        _fill(url, stream, count, size)
        warm = spark.read.format("amqp").option("url", url).option("stream", stream)
        warm.option("endingOffsets", "100").option("minPartitions", str(partitions)).load().count()
        best: dict[str, float] = {}
        for _ in range(repeat):
            runs: tuple[tuple[str, Callable[[], float]], ...] = (
                (PIKA_ROW, lambda: pika_alone(url, stream, count)),
                (SPARK_ROW, lambda: spark_read(spark, url, stream, partitions, count)),
            )
            for name, run in runs:
                seconds = run()
                best[name] = min(seconds, best.get(name, seconds))
        base = count / best[PIKA_ROW]
        out: list[Row] = []
        for name, parts in ((PIKA_ROW, 1), (SPARK_ROW, partitions)):
            rate = count / best[name]
            out.append(
                {
                    "name": f"{name}, {size} B",
                    "way": name,
                    "msgs": count,
                    "seconds": best[name],
                    "rate": rate,
                    "partitions": parts,
                    "rate_per_partition": rate / parts,
                    "body_bytes": size,
                    "vs_pika": rate / base,
                }
            )
        return out
    finally:
        channel.queue_delete(stream)
        connection.close()
        if owned:
            spark.stop()


def table(result: list[Row]) -> str:
    """The rows as a text table."""
    lines = [
        f"{'row':<36} {'body':>6} {'parts':>5} {'seconds':>8} {'msgs/s':>10} "
        f"{'per partition':>13} {'vs pika':>8}"
    ]
    for r in result:
        lines.append(
            f"{r['way']:<36} {r['body_bytes']:>4} B {r['partitions']:>5} {r['seconds']:>8.2f} "
            f"{r['rate']:>10,.0f} {r['rate_per_partition']:>13,.0f} {r['vs_pika']:>7.2f}x"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=MESSAGES)
    parser.add_argument("--size", type=int, default=SIZE, help="body size, bytes")
    parser.add_argument("--partitions", type=int, default=PARTITIONS)
    parser.add_argument("--repeat", type=int, default=1, help="best of this many runs per row")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    result = rows(args.url, args.messages, args.size, args.partitions, args.repeat)
    print(
        f"\n{args.messages:,} messages read from one stream, best of {args.repeat} "
        f"(local[{args.partitions}]):"
    )
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
