"""A streaming query in its own process (its own driver), for the kill and retention tests.

    python stream_child.py URL STREAM OUTPUT CHECKPOINT MODE [OPTION=VALUE ...]

Reads the stream with ``spark.readStream.format("amqp")`` into a parquet file sink with a
checkpoint. MODE ``run`` keeps the query running (the test kills this process); ``drain`` runs
with ``trigger(availableNow=True)`` and exits when the stream's current end is reached. Prints
``batch <id> <rows>`` (flushed) after each micro-batch's progress, i.e. once Spark committed it,
and ``done`` or ``failed <error>`` at the end. Extra ``OPTION=VALUE`` arguments go to the reader.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from pyspark.sql import SparkSession

from reliable_amqp.spark import register


def main() -> int:
    url, stream, output, checkpoint, mode, *extra = sys.argv[1:]
    spark = (
        SparkSession.builder.master("local[2,3]")
        .appName("reliable-amqp-stream-child")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    reader = spark.readStream.format("amqp").option("url", url).option("stream", stream)
    for item in extra:
        key, _, value = item.partition("=")
        reader = reader.option(key, value)
    writer = (
        reader.load()
        .select("message_id", "offset", "value")
        .writeStream.format("parquet")
        .option("path", output)
        .option("checkpointLocation", checkpoint)
    )
    writer = writer.trigger(availableNow=True) if mode == "drain" else writer
    query = writer.start()
    seen = -1
    try:
        while query.isActive:
            progress = query.lastProgress
            if progress is not None and progress["batchId"] > seen:
                seen = progress["batchId"]
                print(f"batch {seen} {progress['numInputRows']}", flush=True)
            time.sleep(0.05)
        for progress in query.recentProgress:
            if progress["batchId"] > seen:
                seen = progress["batchId"]
                print(f"batch {seen} {progress['numInputRows']}", flush=True)
        error = query.exception()
        if error is not None:
            print(f"failed {error}".replace("\n", " | "), flush=True)
            return 1
        print("done", flush=True)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
