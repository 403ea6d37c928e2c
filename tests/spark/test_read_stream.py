"""``spark.readStream.format("amqp")``: micro-batches of stream offsets, exactly once into a
checkpointed parquet sink, across a driver killed with SIGKILL (a real child process; the
restart runs on the test's own session)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from support.spark import CONNECT_ENV
from support.stream import declare_stream, delete_queue, publish, stream_name, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.broker]

CHILD = Path(__file__).with_name("stream_child.py")


@pytest.fixture
def stream(amqp_url: str) -> Iterator[str]:
    name = declare_stream(amqp_url, stream_name("read"))
    yield name
    delete_queue(amqp_url, name)


class Child:
    """``stream_child.py`` in its own process group (its JVM and Python workers with it)."""

    def __init__(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in CONNECT_ENV}
        env["PYSPARK_PYTHON"] = sys.executable
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.rstrip("\n"))

    def batches(self) -> list[tuple[int, int]]:
        return [
            (int(b), int(n))
            for line in list(self.lines)
            if line.startswith("batch ")
            for _, b, n in [line.split()]
        ]

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def output(self) -> str:
        return "\n".join(self.lines) + "\n--- stderr\n" + "\n".join(self.err[-60:])


@pytest.mark.slow
def test_driver_killed_after_two_batches_then_restarted_reads_each_message_once(
    spark: SparkSession, amqp_url: str, stream: str, tmp_path: Path
) -> None:
    output, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    publish(amqp_url, stream, 0, 30_000)
    args = [amqp_url, stream, str(output), str(checkpoint)]
    reader = ["startingOffsets=earliest", "maxMessagesPerTrigger=10000", "minPartitions=2"]
    first = Child(*args, "run", *reader)
    during = threading.Thread(target=publish, args=(amqp_url, stream, 30_000, 20_000))
    try:
        wait_for(lambda: len(first.batches()) >= 1, 180, "a micro-batch", 0.05, first.output)
        during.start()  # 20,000 more while the query runs
        wait_for(lambda: len(first.batches()) >= 2, 120, "two micro-batches", 0.02, first.output)
        first.kill()
    finally:
        if first.proc.poll() is None:
            first.kill()
    done = first.batches()
    assert [n for _, n in done[:2]] == [10_000, 10_000], first.output()
    during.join(120)
    assert not during.is_alive()

    # The restart: this process's session (another driver than the one killed) on the same
    # checkpoint, up to the stream's end (a child of its own cost a JVM start, ~15 s)
    query = (
        spark.readStream.format("amqp")
        .option("url", amqp_url)
        .option("stream", stream)
        .options(**dict(option.split("=", 1) for option in reader))
        .load()
        .select("message_id", "offset", "value")
        .writeStream.format("parquet")
        .option("path", str(output))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(300), "the restarted query did not reach the stream's end"
    assert query.exception() is None, query.exception()
    resumed = [p["batchId"] for p in query.recentProgress]
    assert resumed and resumed[0] >= 2  # it went on from the checkpoint, not from batch 0

    counts = Counter(r.message_id for r in spark.read.parquet(str(output)).collect())
    assert len(counts) == 50_000
    assert set(counts) == {f"m{i}" for i in range(50_000)}
    assert max(counts.values()) == 1  # each message exactly once


def test_latest_and_max_messages_per_trigger_in_session(
    spark: SparkSession, amqp_url: str, stream: str, tmp_path: Path
) -> None:
    publish(amqp_url, stream, 0, 100)  # before the query: not read (startingOffsets latest)
    query = (
        spark.readStream.format("amqp")
        .option("url", amqp_url)
        .option("stream", stream)
        .option("maxMessagesPerTrigger", "30")
        .load()
        .writeStream.format("memory")
        .queryName("amqp_latest")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        # the query has its starting offsets once it waits for data (idle progress events
        # come only every 10 s)
        wait_for(
            lambda: query.status["message"] == "Waiting for data to arrive",
            120,
            "the query's starting offsets",
        )
        publish(amqp_url, stream, 100, 100)
        wait_for(
            lambda: spark.sql("select count(*) from amqp_latest").collect()[0][0] >= 100,
            120,
            "100 new messages",
        )
        query.processAllAvailable()
        ids = [r.message_id for r in spark.sql("select message_id from amqp_latest").collect()]
        assert sorted(ids) == sorted(f"m{i}" for i in range(100, 200))
        sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        assert max(sizes) <= 30 and sum(sizes) == 100
        # the stream's end is in the progress: the lag behind it is visible
        last = query.recentProgress[-1]["sources"][0]
        assert last["latestOffset"] is not None
    finally:
        query.stop()
