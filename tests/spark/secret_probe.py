"""Run by test_spark_secrets.py in a process of its own (a SparkContext with an event log): write
through the ``amqp`` data source, batch and streaming, and through ``foreachPartition``, with the
password given as an option; print the streaming query's ``explain(extended=True)``.

    python secret_probe.py URL USER PASSWORD QUEUE EVENT_LOG_DIR WORK_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from reliable_amqp.spark import AmqpSink, close_cached_publishers, register


def main() -> None:
    url, user, password, queue, event_log, work = sys.argv[1:7]
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.eventLog.enabled", "true")
        .config("spark.eventLog.dir", event_log)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    register(spark)
    df = spark.range(0, 100, numPartitions=2).select(
        F.format_string("batch %d", "id").alias("body"), F.lit(queue).alias("routing_key")
    )
    (
        df.write.format("amqp")
        .mode("append")
        .option("url", url)
        .option("username", user)
        .option("password", password)
        .save()
    )
    source = Path(work) / "in"
    source.mkdir()
    (source / "part.json").write_text(
        "".join(json.dumps({"body": f"stream {i}", "routing_key": queue}) + "\n" for i in range(50))
    )
    stream = spark.readStream.schema("body string, routing_key string").json(str(source))
    query = (
        stream.writeStream.format("amqp")
        .option("url", url)
        .option("username", user)
        .option("password", password)
        .option("checkpointLocation", str(Path(work) / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    query.explain(extended=True)
    sink = AmqpSink.from_options({"url": url, "username": user, "password": password})
    print("sink repr:", repr(sink))
    rows = spark.range(0, 100, numPartitions=2).select(
        F.format_string("rows %d", "id").alias("body"), F.lit(queue).alias("routing_key")
    )
    rows.foreachPartition(sink)
    close_cached_publishers()
    spark.stop()


if __name__ == "__main__":
    main()
