"""The sink on a Spark standalone cluster (a master and two 1-core workers,
tests/support/spark_cluster.py), driven by its own driver process (cluster_driver.py) as users run
it: the three ways in, kill -9 of an executor JVM mid-job, kill -9 of a whole worker mid-job, a
named streaming query stopped mid-batch and restarted from its checkpoint. The tests share one Spark
application (the driver in its ``serve`` mode: a job per command), as a long-running application
sees those faults one after another; starting one per test cost most of each test's time (issue 33).

Each test checks by message id that every row arrived, and that every duplicate carries its first
copy's message_id (at least once, duplicates droppable by id), and prints rows / distinct /
duplicates / same-id duplicates.
"""

from __future__ import annotations

import json
import os
import queue as queues
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest

from support.spark import Received, read_all, unique_name
from support.spark_cluster import SparkCluster
from support.stream import (
    committed_ids,
    declare_stream,
    delete_queue,
    publish,
    stream_name,
    wait_for,
)

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.slow]

DRIVER = Path(__file__).with_name("cluster_driver.py")
ROWS = 32_000
PARTITIONS = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[SparkCluster]:
    """One standalone cluster for this module; a test that killed a worker gets it back."""
    with SparkCluster() as running:
        yield running


@pytest.fixture
def workers(cluster: SparkCluster) -> SparkCluster:
    """The cluster with both workers up (restarted if an earlier test killed one)."""
    cluster.restart_dead_workers()
    return cluster


class Application:
    """One Spark application for the module's tests: cluster_driver.py in ``serve`` mode, which
    runs a job per command line and answers each with a JSON line."""

    def __init__(self, master: str, log: Path) -> None:
        self.log = log
        self.process = start_driver("serve", {"master": master}, log, commands=True)
        self._lines: queues.Queue[str | None] = queues.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)  # the driver ended

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, mode: str, config: dict[str, Any]) -> None:
        """Start a job (``mode`` with ``config``); :meth:`result` waits for its end."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"mode": mode, **config}) + "\n")
        self.process.stdin.flush()

    def result(self, timeout: float = 200) -> dict[str, Any]:
        """The job's result (the JSON line it printed); fails when it failed."""
        try:
            line = self._lines.get(timeout=timeout)
        except queues.Empty:
            raise AssertionError(f"no result within {timeout:g} s:\n{self._tail()}") from None
        assert line is not None, f"driver ended ({self.process.poll()}):\n{self._tail()}"
        result: dict[str, Any] = json.loads(line)
        assert result.pop("ok"), f"{result.get('error')}\n{self._tail()}"
        return result

    def _tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # serve() ends, the application stops
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def application(
    cluster: SparkCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Application]:
    """The module's Spark application."""
    running = Application(cluster.url, tmp_path_factory.mktemp("driver") / "driver.log")
    yield running
    running.close()


@pytest.fixture
def app(application: Application, workers: SparkCluster) -> Application:
    """The shared application, on a cluster with both workers up."""
    assert application.alive, f"the shared Spark application ended ({application.process.poll()})"
    return application


def start_driver(
    mode: str, config: dict[str, Any], log: Path, *, commands: bool = False
) -> subprocess.Popen[str]:
    """Run cluster_driver.py in its own process (a Spark application's driver)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
    env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, str(DRIVER), mode, json.dumps(config)],
            stdin=subprocess.PIPE if commands else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )


def depth(url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def wait_for_depth(url: str, queue: str, at_least: int, driver: subprocess.Popen[str]) -> int:
    """Poll the queue until it holds ``at_least`` messages (mid-job)."""
    deadline = time.monotonic() + 120
    while (now := depth(url, queue)) < at_least:
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            raise AssertionError(f"{now} messages and no job under way (driver {driver.poll()})")
        time.sleep(0.05)
    return now


@dataclass
class Tally:
    """What a queue holds, by id: every row, and what the duplicates look like."""

    rows: int
    received: int
    distinct: int
    duplicates: int
    same_id_duplicates: int

    def line(self, what: str) -> str:
        return (
            f"{what}: rows={self.rows} received={self.received} distinct={self.distinct} "
            f"duplicates={self.duplicates} same-id duplicates={self.same_id_duplicates}"
        )


def tally(received: list[Received], expected: dict[str, int]) -> Tally:
    """Check ``received`` against ``expected`` (message id -> row number n of body ``row {n}``).

    Every expected id arrived with its row's body and nothing else arrived; every duplicate of a
    row carries the id of that row's first copy.
    """
    first: dict[int, str] = {}
    same = 0
    for m in received:
        n = int(m.body.decode().split()[1])
        assert m.message_id is not None
        assert expected.get(m.message_id) == n, f"{m.message_id!r} carries row {n}"
        if n in first:
            same += first[n] == m.message_id
        else:
            first[n] = m.message_id
    ids = {m.message_id for m in received}
    assert ids == set(expected), f"missing ids: {len(set(expected) - ids)}"
    duplicates = len(received) - len(ids)
    return Tally(len(expected), len(received), len(ids), duplicates, same)


def range_ids(prefix: str, rows: int = ROWS, partitions: int = PARTITIONS) -> dict[str, int]:
    """The ids the sink derives for ``spark.range(rows, numPartitions=partitions)``."""
    per = rows // partitions
    return {f"{prefix}:{p}:{i}": p * per + i for p in range(partitions) for i in range(per)}


def check(received: list[Received], expected: dict[str, int], what: str) -> Tally:
    counts = tally(received, expected)
    print(counts.line(what))
    assert counts.same_id_duplicates == counts.duplicates
    return counts


def test_three_ways_in_deliver_every_row(app: Application, broker: Any, amqp_url: str) -> None:
    ways = ("foreach", "write", "format")
    names = {w: broker.queue(unique_name(f"cl-{w}")) for w in ways}
    prefixes = {w: unique_name(w) for w in ways}
    rows = 12_000
    config = {
        "url": amqp_url,
        "rows": rows,
        "partitions": PARTITIONS,
        "queues": names,
        "prefixes": prefixes,
    }
    app.start("ways", config)
    result = app.result()
    assert result["write"]["rows"] == rows
    for way in ways:
        received = read_all(amqp_url, names[way], expected=rows)
        counts = check(received, range_ids(prefixes[way], rows), f"{way} ({result[way]})")
        assert counts.duplicates == 0  # nothing failed: no task ran twice


def _write_while(
    app: Application, broker: Any, amqp_url: str, kill: Any
) -> tuple[Tally, dict[str, Any], list[int]]:
    queue = broker.queue(unique_name("cl-kill"))
    prefix = unique_name("kill")
    config = {
        "url": amqp_url,
        "rows": ROWS,
        "partitions": PARTITIONS,
        "queue": queue,
        "prefix": prefix,
    }
    app.start("write", config)
    seen = wait_for_depth(amqp_url, queue, ROWS // 4, app.process)
    killed = kill()
    print(f"killed {killed} with {seen} of {ROWS} rows in the queue")
    result = app.result()
    assert result["rows"] == ROWS  # the job succeeded: every row confirmed once counted
    received = read_all(amqp_url, queue, expected=ROWS)
    return check(received, range_ids(prefix), "after kill -9"), result, killed


def test_kill_9_of_an_executor_mid_job(
    app: Application, workers: SparkCluster, broker: Any, amqp_url: str
) -> None:
    def kill_executor() -> list[int]:
        executors = workers.executors()
        assert executors, "no executor JVM runs under the workers"
        os.kill(executors[0], signal.SIGKILL)
        return executors[:1]

    _write_while(app, broker, amqp_url, kill_executor)


def test_kill_9_of_a_worker_mid_job(
    app: Application, workers: SparkCluster, broker: Any, amqp_url: str
) -> None:
    def kill_worker() -> list[int]:
        busy = [w for w in workers.workers if workers.executors(w)]
        assert busy, "no worker runs an executor"
        return workers.kill_worker(busy[0])

    _, _, killed = _write_while(app, broker, amqp_url, kill_worker)
    assert len(killed) >= 2  # the worker and its executor (and its Python workers)


def test_named_streaming_query_stopped_mid_batch_resumes_from_its_checkpoint(
    app: Application, broker: Any, amqp_url: str, tmp_path: Path
) -> None:
    queue = broker.queue(unique_name("cl-stream"))
    source = tmp_path / "in"
    source.mkdir()
    files, per_file = 3, 8_000
    for f in range(files):  # oldest first: one file per micro-batch, in this order
        lines = [json.dumps({"n": f * per_file + i}) for i in range(per_file)]
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")
        os.utime(source / f"part-{f}.json", (1_000_000 + f, 1_000_000 + f))
    config = {
        "url": amqp_url,
        "queue": queue,
        "source": str(source),
        "checkpoint": str(tmp_path / "checkpoint"),
        "query_name": f"orders_{os.getpid()}",
        "stop_at": per_file + per_file // 8,  # early in the second batch
    }
    app.start("stream", config)
    result = app.result(timeout=400)
    print(f"stream: {result}")
    assert result["restarted_id"] == result["query_id"]  # the checkpoint kept the query's id
    received = read_all(amqp_url, queue, expected=files * per_file)
    query = result["query_id"]
    # ids: {query id}:b{batch}:{partition}:{position}; one file, one partition per batch
    expected = {
        f"{query}:b{b}:0:{i}": b * per_file + i for b in range(files) for i in range(per_file)
    }
    counts = check(received, expected, "stream stopped mid-batch and restarted")
    assert counts.duplicates > 0  # the stopped batch was replayed, with the same ids
    tail = result["depth_settled"] - result["depth_when_stop_returned"]
    print(f"stream: {tail} messages reached the queue after query.stop() returned")


def test_stream_read_with_an_executor_killed_reads_each_message_once(
    app: Application, workers: SparkCluster, amqp_url: str, tmp_path: Path
) -> None:
    """issue 41: 50,000 messages (30,000 before the query, 20,000 while it runs) read from a
    stream into a checkpointed parquet sink; an executor JVM killed -9 after two committed
    micro-batches. The query goes on (Spark reruns the lost tasks on the same ranges), a second
    run on the checkpoint reads the rest, and each message is in the output exactly once."""
    stream = declare_stream(amqp_url, stream_name("cluster"))
    output, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    config = {
        "url": amqp_url,
        "stream": stream,
        "per_trigger": 10_000,
        "output": str(output),
        "checkpoint": str(checkpoint),
    }
    try:
        publish(amqp_url, stream, 0, 30_000)
        app.start("read_stream", config)
        commits = checkpoint / "commits"
        wait_for((commits / "0").exists, 180, "the first committed micro-batch", 0.05, app._tail)
        during = threading.Thread(target=publish, args=(amqp_url, stream, 30_000, 20_000))
        during.start()
        wait_for((commits / "1").exists, 180, "two committed micro-batches", 0.02, app._tail)
        executors = workers.executors()
        assert executors, "no executor JVM runs under the workers"
        os.kill(executors[0], signal.SIGKILL)
        first = app.result(300)
        during.join(120)
        assert not during.is_alive()
        workers.restart_dead_workers()
        app.start("read_stream", config)  # the same checkpoint: only what is left
        second = app.result(300)
        ids = committed_ids(output)
        counts = Counter(ids)
        assert set(counts) == {f"m{i}" for i in range(50_000)}, (first, second, len(counts))
        assert max(counts.values()) == 1  # each message exactly once
        assert first["rows"] + second["rows"] >= 50_000  # (a replayed batch counts twice)
    finally:
        delete_queue(amqp_url, stream)
