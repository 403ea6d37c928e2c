"""Issue 45, on the three-node RabbitMQ 4 cluster: the Spark reader through node kills.

A replicated stream (a member on each node, the leader on node 0) is read by a streaming query
(``spark.readStream.format("amqp")`` into a parquet file sink with a checkpoint,
``maxMessagesPerTrigger`` 1,500, ``prefetch`` 1 so that a task reads for about a second, every
node's URL with node 1 first) in a child driver (``tests/spark/stream_child.py``). Two nodes are
killed -9, each 0.4 s after the driver planned a micro-batch, while its task reads:

- node 1, the one the reader's connections are on, in the second micro-batch (the task's
  connection is lost; Spark reruns the task on the same offset range, through the next URL);
  the node is started again;
- node 0, the stream's leader, in the first micro-batch of 3,000 more messages published
  meanwhile (the reader is on node 1 again; RabbitMQ closes its connection, 541, while the two
  members left elect a leader; the rerun reads the range).

Exactly once into the checkpointed sink: the files the sink committed hold each of the 6,000
message ids once, none missing. The summary line gives the micro-batches, the task attempts
that failed (2 when both kills hit a read) and the pause from each kill to the next committed
micro-batch. About 30-35 s, plus the cluster's start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from harness.rabbitmq4 import Rabbitmq4Cluster, Rabbitmq4Node
from support.broker import unique
from support.run_summary import add_summary
from support.stream import committed_ids, delete_queue, publish

pytestmark = [pytest.mark.broker, pytest.mark.faults, pytest.mark.slow, pytest.mark.spark]

#: messages published before the query starts, and again once the connected node is back
HALF = 3_000
TOTAL = 2 * HALF
PER_BATCH = 1_500
#: how far into a micro-batch a kill comes, once it is planned (its task starts within about
#: 0.2 s and reads 1,500 messages at prefetch 1 for about a second)
INTO_BATCH = 0.4
CHILD = Path(__file__).resolve().parents[1] / "spark" / "stream_child.py"
LEADER, CONNECTED = 0, 1


def _declare(node: Rabbitmq4Node, name: str) -> None:
    """A stream with a member on each of the three nodes, its leader on ``node``."""
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        connection.channel().queue_declare(
            name,
            durable=True,
            arguments={
                "x-queue-type": "stream",
                "x-initial-cluster-size": 3,
                "x-queue-leader-locator": "client-local",
            },
        )
    finally:
        connection.close()


class Driver:
    """The child driver and what it printed: ``batch <id> <rows>`` per committed micro-batch."""

    def __init__(self, urls: list[str], stream: str, out: Path, checkpoint: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_CONNECT")}
        env["PYSPARK_PYTHON"] = sys.executable
        env["RELIABLE_AMQP_SPARK_LOG"] = "DEBUG"
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came
        self.changed = threading.Condition()
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), ",".join(urls), stream, str(out), str(checkpoint),
             "run", "startingOffsets=earliest", f"maxMessagesPerTrigger={PER_BATCH}",
             "prefetch=1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.errors: list[str] = []
        self.planned = 0  # micro-batches planned (the driver's DEBUG line)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line.strip())
                self.times.append(time.monotonic())
                self.changed.notify_all()
        with self.changed:
            self.lines.append("<eof>")
            self.changed.notify_all()

    def _drain_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self.changed:
                self.errors.append(line.rstrip())
                if "amqp: micro-batch" in line:
                    self.planned += 1
                self.changed.notify_all()

    def wait_for_planned(self, count: int, timeout: float) -> None:
        """Until the driver planned its ``count``-th micro-batch (its tasks start next)."""
        with self.changed:
            done = self.changed.wait_for(
                lambda: self.planned >= count or "<eof>" in self.lines, timeout
            )
        assert done and self.planned >= count, self.describe()

    def batches(self) -> int:
        return sum(1 for line in self.lines if line.startswith("batch "))

    def rows(self) -> int:
        """Rows of the committed micro-batches (``batch <id> <rows>``: once per batch id)."""
        return sum(int(line.split()[2]) for line in self.lines if line.startswith("batch "))

    def wait_for_rows(self, count: int, timeout: float) -> None:
        """Until micro-batches of ``count`` rows in all were committed."""
        with self.changed:
            done = self.changed.wait_for(
                lambda: self.rows() >= count or "<eof>" in self.lines, timeout
            )
        assert done and self.rows() >= count, self.describe()

    def pause_after(self, moment: float) -> float:
        """Seconds from ``moment`` to the next committed micro-batch (inf: none came)."""
        later = [
            at
            for at, line in zip(self.times, self.lines, strict=False)
            if at > moment and line.startswith("batch ")
        ]
        return min(later, default=float("inf")) - moment

    def describe(self) -> str:
        return "\n".join([*self.lines[-20:], "-- stderr --", *self.errors[-60:]])


@pytest.fixture
def stream(healthy: Rabbitmq4Cluster) -> Iterator[str]:
    name = unique("ra-cluster-read")
    _declare(healthy.nodes[LEADER], name)
    yield name
    node = next(n for n in healthy.nodes if n.is_running())
    delete_queue(node.url, name)


def test_node_kills_mid_batch_read_each_message_once_into_a_checkpointed_sink(
    healthy: Rabbitmq4Cluster, stream: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    nodes = healthy.nodes
    assert healthy.leader(stream) is nodes[LEADER]
    publish(nodes[LEADER].url, stream, 0, HALF, size=200, max_in_flight=500)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    urls = [nodes[CONNECTED].url, nodes[LEADER].url, nodes[2].url]
    began = time.monotonic()
    driver = Driver(urls, stream, out, checkpoint)
    kills: list[float] = []

    def kill_mid_batch(node: Rabbitmq4Node, batch: int) -> None:
        driver.wait_for_planned(batch + 1, 120)  # micro-batch ``batch``: its task is to read
        time.sleep(INTO_BATCH)
        kills.append(time.monotonic())
        node.kill()

    try:
        kill_mid_batch(nodes[CONNECTED], 1)  # offsets 1500..2999
        nodes[CONNECTED].start()  # (the query goes on meanwhile, through the next URL)
        driver.wait_for_rows(HALF, 120)
        publish(nodes[2].url, stream, HALF, HALF, size=200, max_in_flight=500)
        kill_mid_batch(nodes[LEADER], 2)  # 3000..4499 (the reader is on node 1 again)
        driver.wait_for_rows(TOTAL, 180)
    finally:
        driver.process.kill()
        driver.process.wait(30)
    seconds = time.monotonic() - began
    pauses = [driver.pause_after(moment) for moment in kills]
    failed = sum(1 for line in driver.errors if "Exception in task" in line)

    ids = committed_ids(out)
    expected = {f"m{i}" for i in range(TOTAL)}
    duplicates = len(ids) - len(set(ids))
    missing = expected - set(ids)
    add_summary(
        request,
        "rabbitmq 4",
        f"spark read of a 3-member stream, {TOTAL} messages, kill -9 of the connected node "
        f"and then of the leader's, each {INTO_BATCH} s into a micro-batch: "
        f"{len(ids)} rows committed, {duplicates} duplicates, {len(missing)} missing, "
        f"{driver.batches()} micro-batches, {seconds:.1f} s; next batch committed "
        f"{pauses[0]:.1f} s and {pauses[1]:.1f} s after the kills; {failed} task attempts "
        "failed",
    )
    assert not missing, sorted(missing)[:10]
    assert duplicates == 0
    assert set(ids) == expected
