"""Retention removed offsets a checkpoint still expects: a clear failure by default, and with
``failOnDataLoss=false`` a loud skip (a WARNING with the count), as Kafka's source does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.spark._stream import Connector, first_offset
from support.spark import CONNECT_ENV
from support.stream import declare_stream, delete_queue, publish, stream_name, wait_for

pytestmark = [
    pytest.mark.spark,
    pytest.mark.broker,
    pytest.mark.slow,
    # LavinMQ's retention settings and segment sizes differ; the reader's checks do not
    pytest.mark.rabbitmq_only(reason="x-stream-max-segment-size-bytes makes retention quick"),
]

CHILD = Path(__file__).with_name("stream_child.py")


def _first(url: str, stream: str) -> int:
    connection = Connector(PublisherOptions.create(url)).connect()
    try:
        found = first_offset(connection, stream, held=True)  # (it holds messages)
        assert found is not None, "retention left the stream empty"
        return found
    finally:
        connection.close()


def _query(spark: SparkSession, url: str, stream: str, out: Path, checkpoint: Path) -> object:
    return (
        spark.readStream.format("amqp")
        .option("url", url)
        .option("stream", stream)
        .option("startingOffsets", "earliest")
        .load()
        .select("message_id", "offset", "value")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def test_offsets_removed_under_a_checkpoint(
    spark: SparkSession, amqp_url: str, tmp_path: Path
) -> None:
    stream = declare_stream(
        amqp_url,
        stream_name("retention"),
        x_max_length_bytes=100_000,
        x_stream_max_segment_size_bytes=20_000,
    )
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    try:
        publish(amqp_url, stream, 0, 10, size=1000)
        query = _query(spark, amqp_url, stream, out, checkpoint)
        query.awaitTermination(180)  # type: ignore[attr-defined]
        assert query.exception() is None  # type: ignore[attr-defined]
        assert spark.read.parquet(str(out)).count() == 10

        # 300 more of 1 KB: retention drops the segments that held offsets 10.. (the
        # checkpoint's next offset). At most 10 in flight: RabbitMQ writes every message it has
        # at hand as one chunk, and a segment ends only after the chunk that passes 20 KB, so
        # with 300 in flight one segment can pass the 100 KB limit by itself; when that is the
        # segment before a new (empty) one, retention removes every message (seen on 3.10: the
        # stream left empty, 1 run in 10). Chunks of 10 KB keep segments under 35 KB: the one
        # before the newest always stays.
        publish(amqp_url, stream, 10, 300, size=1000, max_in_flight=10)
        wait_for(lambda: _first(amqp_url, stream) > 10, 60, "retention to remove offset 10")

        again = _query(spark, amqp_url, stream, out, checkpoint)
        with pytest.raises(Exception, match="removed by retention") as failed:
            again.awaitTermination(180)  # type: ignore[attr-defined]
        text = str(failed.value)
        assert re.search(r"offsets 10\.\.\d+ \(\d+ offsets\) were removed by retention", text)
        assert "failOnDataLoss" in text
        with pytest.raises(Exception, match="removed by retention"):
            spark.read.format("amqp").option("url", amqp_url).option("stream", stream).option(
                "startingOffsets", "0"
            ).load().collect()
        skipped = (
            spark.read.format("amqp")
            .option("url", amqp_url)
            .option("stream", stream)
            .option("startingOffsets", "0")
            .option("failOnDataLoss", "false")
            .load()
        )
        # what retention kept: a tail of the messages (offsets are not message numbers: a
        # stream's segments begin with an entry of their own, which takes an offset)
        tail = sorted(int(r.message_id[1:]) for r in skipped.select("message_id").collect())
        assert tail == list(range(tail[0], 310)) and tail[0] > 10
        first = _first(amqp_url, stream)

        # The same checkpoint with failOnDataLoss=false, in a driver of its own (its stderr is
        # where the driver-side WARNING goes): the skip is loud, and the rest is read once.
        env = {k: v for k, v in os.environ.items() if k not in CONNECT_ENV}
        env["PYSPARK_PYTHON"] = sys.executable
        done = subprocess.run(
            [sys.executable, str(CHILD), amqp_url, stream, str(out), str(checkpoint), "drain",
             "startingOffsets=earliest", "failOnDataLoss=false"],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        warning = re.search(
            r"WARNING amqp: stream '[^']+': skipping (\d+) offsets \(10\.\.(\d+)\)", done.stderr
        )
        assert warning is not None, done.stderr[-4000:]
        assert _first(amqp_url, stream) == first  # (retention had settled)
        assert (int(warning.group(1)), int(warning.group(2))) == (first - 10, first - 1)
        counts = Counter(r.message_id for r in spark.read.parquet(str(out)).collect())
        expected = [f"m{i}" for i in range(10)] + [f"m{i}" for i in tail]
        assert sorted(counts) == sorted(expected)
        assert max(counts.values()) == 1
    finally:
        delete_queue(amqp_url, stream)
