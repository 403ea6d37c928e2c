"""The ``amqp`` Spark data source: a batch write and a streaming query, options as strings.

Runs against the local RabbitMQ (or $AMQP_URL) on a local SparkSession:

1. ``df.write.format("amqp").mode("append")`` writes 1,000 rows (``id_prefix`` makes the message
   ids ``{id_prefix}:{partition}:{position}``, the same if the job is run again);
2. ``writeStream.format("amqp").queryName(...)`` reads three JSON files as three micro-batches
   (``maxFilesPerTrigger=1``, ``availableNow``) with a checkpoint; message ids carry the query id
   and the batch id, so a batch replayed after a failure republishes the same ids.

Publisher options and retry policies are plain string options (``nack_policy.max_attempts``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path

import pika
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from reliable_amqp import Publisher
from reliable_amqp.spark import register

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = os.environ.get("SPARK_DS_QUEUE", f"example-spark-ds-{uuid.uuid4().hex[:8]}")


def drain(queue: str) -> list[str]:
    """The message ids in the queue, emptying it."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=1000)
    ids = []
    for method, props, _body in channel.consume(queue, auto_ack=True, inactivity_timeout=1):
        if method is None:
            break
        ids.append(props.message_id)
    channel.cancel()
    connection.close()
    return ids


def main() -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # The driver-side commit of each write logs its totals; show them (on stderr).
    os.environ.setdefault("RELIABLE_AMQP_SPARK_LOG", "INFO")
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("reliable-amqp spark_datasource example")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)  # format "amqp"
    with Publisher(URL) as publisher:
        publisher.declare_queue(QUEUE, durable=True)
    options = {
        "url": URL,
        "routing_key": QUEUE,
        "delivery_timeout": "60",
        "max_in_flight": "5000",
        "nack_policy.max_attempts": "3",
        "nack_policy.initial_delay": "0.1",
    }
    ok = True

    # 1. batch
    events = spark.range(0, 1000, numPartitions=2).select(
        F.format_string("event %d", "id").alias("body"),
        F.lit("text/plain").alias("content_type"),
    )
    job = f"events-{uuid.uuid4().hex[:8]}"
    events.write.format("amqp").mode("append").options(**options).option("id_prefix", job).save()
    ids = drain(QUEUE)
    print(f"batch write: {len(ids)} messages confirmed, ids like {sorted(ids)[0]!r}")
    ok &= len(set(ids)) == 1000

    # 2. streaming, three micro-batches
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "in")
        source.mkdir()
        for f in range(3):
            # "value", as a DataFrame for Spark's Kafka sink has it: it is the body here too
            rows = [json.dumps({"value": f"file {f} line {i}"}) for i in range(100)]
            (source / f"part-{f}.json").write_text("\n".join(rows) + "\n")
        query = (
            spark.readStream.schema("value string")
            .option("maxFilesPerTrigger", 1)
            .json(str(source))
            .writeStream.format("amqp")
            .queryName("files_to_amqp")  # Spark adds it to the options: the sink ignores it
            .options(**options)
            .option("checkpointLocation", str(Path(tmp, "checkpoint")))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        batches = query.lastProgress["batchId"] + 1 if query.lastProgress else 0
    ids = drain(QUEUE)
    per_batch = Counter(i.split(":")[1] for i in ids)
    print(f"streaming: {batches} micro-batches, {len(ids)} messages, per batch {dict(per_batch)}")
    ok &= len(set(ids)) == 300 and len(per_batch) == 3

    spark.stop()
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    connection.channel().queue_delete(QUEUE)
    connection.close()
    print(f"queue {QUEUE!r} deleted; {'all rows confirmed' if ok else 'MISSING ROWS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
