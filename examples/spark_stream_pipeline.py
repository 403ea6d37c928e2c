"""A complete Spark pipeline on a stream: read it exactly once, transform, write a table, and
publish derived events back through the sink.

Runs against the local RabbitMQ (or $AMQP_URL) on a local SparkSession:

1. declares a stream ``orders`` (a RabbitMQ or LavinMQ stream queue) and publishes 1,000 order
   events to it with confirms (as a service or an outbox relay would);
2. ``spark.readStream.format("amqp")`` reads the stream from its first offset, 400 messages per
   micro-batch (``maxMessagesPerTrigger``), with a checkpoint: each micro-batch is an offset
   range fixed before it runs, so a restart replays the same messages;
3. each micro-batch (``foreachBatch``) parses the JSON bodies, writes the orders to a parquet
   table (one directory per batch id, overwritten if Spark replays the batch: the table holds
   each order once), and publishes one event per order above 900 to a queue through the
   ``amqp`` sink (at least once: a replayed batch republishes the same message ids);
4. a second run on the same checkpoint reads only what was published since.

Prints the table's row count and the derived events' count.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

import pika
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from reliable_amqp import Publisher
from reliable_amqp.spark import AmqpSink, register

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
ORDER = "customer string, amount int"


def publish_orders(stream: str, start: int, count: int) -> None:
    """Order events, confirmed by the broker (the stream keeps them for every reader)."""
    with Publisher(URL) as publisher:
        for i in range(start, start + count):
            body = json.dumps({"customer": f"c{i % 13}", "amount": (i * 37) % 1000})
            publisher.publish(
                "", stream, body.encode(), message_id=f"order-{i}", content_type="application/json"
            )
        assert publisher.flush(60) == 0, "some orders were not confirmed"


def run(spark: SparkSession, stream: str, table: Path, checkpoint: Path, sink: AmqpSink) -> None:
    """One run of the pipeline: everything in the stream now, then stop."""
    orders = (
        spark.readStream.format("amqp")
        .option("url", URL)
        .option("stream", stream)
        .option("startingOffsets", "earliest")  # for a new checkpoint; a restart resumes
        .option("maxMessagesPerTrigger", "400")
        .load()
        .select(
            "message_id",
            "offset",
            "timestamp",
            F.from_json(F.col("value").cast("string"), ORDER).alias("order"),
        )
        .select("message_id", "offset", "order.*")
    )

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        # overwrite this batch's own directory: a replay after a crash writes it again, once
        batch.write.mode("overwrite").parquet(str(table / f"batch_id={batch_id}"))
        large = batch.where(F.col("amount") > 900).select(
            F.to_json(F.struct("message_id", "customer", "amount")).alias("body")
        )
        sink.for_batch(large, batch_id)  # derived events, confirmed before the batch commits

    query = (
        orders.writeStream.foreachBatch(each_batch)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def main() -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("reliable-amqp stream pipeline")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    suffix = uuid.uuid4().hex[:8]
    stream, derived = f"orders-{suffix}", f"large-orders-{suffix}"
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    channel.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
    channel.queue_declare(derived, durable=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            table, checkpoint = Path(tmp) / "orders", Path(tmp) / "checkpoint"
            sink = AmqpSink(URL, routing_key=derived, id_prefix=f"pipeline-{suffix}")
            publish_orders(stream, 0, 1000)
            run(spark, stream, table, checkpoint, sink)
            publish_orders(stream, 1000, 200)  # more events; the restart reads only these
            run(spark, stream, table, checkpoint, sink)
            rows = spark.read.parquet(str(table))
            ids = rows.select(F.countDistinct("message_id")).collect()[0][0]
            large = rows.where(F.col("amount") > 900).count()
            events = channel.queue_declare(derived, passive=True).method.message_count
            print(f"table: {rows.count()} orders ({ids} distinct), {large} above 900")
            print(f"derived events confirmed in {derived}: {events}")
            assert rows.count() == ids == 1200
            assert events == large
    finally:
        channel.queue_delete(stream)
        channel.queue_delete(derived)
        connection.close()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
