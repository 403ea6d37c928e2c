"""Write a DataFrame to RabbitMQ with AmqpSink: every row confirmed by the broker, at least once.

Runs against the local RabbitMQ (or $AMQP_URL) on a local SparkSession: declares a durable queue,
writes 10,000 order rows with ``sink.write(df)`` (rows move to Python as Arrow batches; the call
returns once every row is confirmed), then writes the first 100 rows again with
``df.foreachPartition(sink)``. Those 100 arrive twice, with the same ``message_id`` (taken from a
column), which is how a consumer drops the duplicates that at-least-once delivery allows.
"""

from __future__ import annotations

import os
import sys
import uuid

import pika
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from reliable_amqp import Publisher
from reliable_amqp.spark import AmqpSink

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = os.environ.get("SPARK_SINK_QUEUE", f"example-spark-sink-{uuid.uuid4().hex[:8]}")
ROWS = 10_000


def read_back(queue: str) -> tuple[int, int]:
    """(messages, distinct message ids) in the queue, emptying it."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=1000)
    ids: list[str] = []
    for method, props, _body in channel.consume(queue, auto_ack=True, inactivity_timeout=1):
        if method is None:
            break
        ids.append(props.message_id)
    channel.cancel()
    channel.queue_delete(queue)
    connection.close()
    return len(ids), len(set(ids))


def main() -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers run this interpreter
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("reliable-amqp spark_sink example")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    with Publisher(URL) as publisher:
        publisher.declare_queue(QUEUE, durable=True)

    orders = spark.range(0, ROWS, numPartitions=2).select(
        # a struct body is written as JSON (content_type application/json)
        F.struct(F.col("id").alias("order"), (F.col("id") * 2.5).alias("amount")).alias("body"),
        F.format_string("order-%d", "id").alias("message_id"),
        F.create_map(F.lit("source"), F.lit("spark_sink example")).alias("headers"),
    )
    sink = AmqpSink(
        URL,
        routing_key=QUEUE,  # default exchange: the routing key is the queue name
        delivery_timeout=60,
        nack_policy={"max_attempts": 3, "initial_delay": 0.1},
    )
    summary = sink.write(orders)
    print(
        f"sink.write: {summary.rows} rows confirmed from {summary.partitions} partitions "
        f"in {summary.seconds:.1f} s ({summary.rate:,.0f} rows/s)"
    )
    orders.limit(100).foreachPartition(sink)
    print("foreachPartition: 100 rows written again (same message ids)")
    spark.stop()

    messages, distinct = read_back(QUEUE)
    print(
        f"queue {QUEUE!r}: {messages} messages, {distinct} distinct message ids "
        f"({messages - distinct} duplicates a consumer drops by message_id); queue deleted"
    )
    return 0 if (messages, distinct) == (ROWS + 100, ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
