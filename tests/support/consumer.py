"""Support for the consumer's fault tests: messages in, a child consumer, its record read back.

The child (``child_consumer.py``) runs a :class:`reliable_amqp.Consumer` in a process of its own
and appends what its handler does to a file; :class:`ChildConsumer` starts it, kills it and reads
that file. Waits are on events (lines in the file, a queue count, a process exit), each bounded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from reliable_amqp import Consumer, Delivery, Publisher, RetryPolicy
from reliable_amqp._core.redelivery import delay_levels, delay_queue

CHILD = Path(__file__).resolve().parents[1] / "consumer" / "child_consumer.py"
#: a short redelivery policy, so the delay queues a consumer declares are few and quick
QUICK = RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=0.2, jitter=0.0)


def fill(url: str, queue: str, ids: Iterable[str], **properties: Any) -> int:
    """Publish one message per id (body and ``message_id`` both the id), all confirmed."""
    with Publisher(url, max_in_flight=2000) as publisher:
        futures = [
            publisher.publish("", queue, message_id.encode(), message_id=message_id, **properties)
            for message_id in ids
        ]
        assert publisher.flush(timeout=120) == 0, "the test's messages were not all confirmed"
    failed = [f.exception() for f in futures if f.exception() is not None]
    assert not failed, f"{len(failed)} of the test's messages failed: {failed[0]!r}"
    return len(futures)


def side_queues(queue: str, policy: RetryPolicy = QUICK) -> list[str]:
    """The queues a consumer of ``queue`` declares besides it: dead letters and delay levels."""
    return [f"{queue}.dead", *(delay_queue(queue, level) for level in delay_levels(policy))]


def delete_queues(url: str, names: Iterable[str]) -> None:
    """Delete queues (those a consumer declared for itself), whatever state they are in."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for name in names:
            channel.queue_delete(name)
    finally:
        connection.close()


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.02
) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def record_lines(path: Path) -> list[str]:
    """The complete lines of a record file that child processes append to, one ``os.write`` per
    line: a read racing a write can see the last line cut short (seen in CI: ``'H k00873 b 1 0
    26910 '``), so text after the last newline is left for the next read."""
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


class Record:
    """What one or more child consumers wrote to their shared file."""

    def __init__(self, lines: list[str]) -> None:
        self.started: list[tuple[str, int, bool]] = []
        self.handled: list[tuple[str, int, bool]] = []
        self.exits: list[dict[str, Any]] = []
        self.subscribed = 0
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind in ("S", "H"):
                message_id, attempt, redelivered = rest.split(" ")
                row = (message_id, int(attempt), redelivered == "1")
                (self.started if kind == "S" else self.handled).append(row)
            elif kind == "SUBSCRIBED":
                self.subscribed += 1
            elif kind == "EXIT":
                self.exits.append(json.loads(rest))

    def handled_ids(self) -> Counter[str]:
        """How many times the handler returned for each message id."""
        return Counter(message_id for message_id, _, _ in self.handled)

    def started_ids(self) -> Counter[str]:
        """How many times the handler was called for each message id."""
        return Counter(message_id for message_id, _, _ in self.started)


class ChildConsumer:
    """Child consumer processes that share one record file (one after another, or at once)."""

    def __init__(self, tmp: Path, url: str, queue: str, **config: Any) -> None:
        self.out = tmp / "record.txt"
        self.out.touch()
        self.stderr = tmp / "stderr.txt"
        self.config = {"url": url, "queue": queue, "out": str(self.out), **config}
        self.proc: subprocess.Popen[bytes] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, **overrides: Any) -> subprocess.Popen[bytes]:
        """Start one more child (``overrides`` change its config)."""
        config = {**self.config, **overrides}
        with open(self.stderr, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps(config)],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.proc = proc
        self.procs.append(proc)
        return proc

    def record(self) -> Record:
        return Record(record_lines(self.out))

    def wait_record(self, predicate: Callable[[Record], bool], timeout: float, what: str) -> Record:
        """Wait until the record satisfies ``predicate``; fails early if the child died."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.record()
            if predicate(record):
                return record
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                record = self.record()  # it may have written its last lines as it ended
                if predicate(record):
                    return record
                raise AssertionError(
                    f"the child consumer exited ({proc.returncode}) before {what}:\n"
                    f"{self.errors()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {what}\n{self.errors()[-3000:]}"
                )
            time.sleep(0.02)

    def gate(self, count: int) -> None:
        """Let a child paused at handled count ``count`` go on."""
        Path(f"{self.out}.gate{count}").touch()

    def kill9(self) -> None:
        """SIGKILL the current child and reap it."""
        proc = self.proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL

    def terminate(self, timeout: float = 30.0) -> tuple[int, float]:
        """SIGTERM the current child; (exit code, seconds it took to exit)."""
        proc = self.proc
        assert proc is not None
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout)
        return code, time.monotonic() - began

    def errors(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""

    def close(self) -> None:
        """Kill whatever child still runs (a failed test)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def ready_count(url: str, queue: str) -> int:
    """Messages ready in ``queue`` (a passive declare: exact on quorum queues too); 0 for a
    queue not declared yet."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != 404:
            raise
        return 0
    finally:
        connection.close()


def supervise_crash_loop(
    child: ChildConsumer, ids: list[str], poison: str, max_restarts: int, timeout: float = 60
) -> tuple[Record, int]:
    """Run child consumers one after another, as a supervisor (systemd, Kubernetes) would,
    restarting each that dies, until every id but ``poison`` was handled and ``poison`` is in
    the dead-letter queue; then stop the last one with SIGTERM. Returns (record, deaths)."""
    url = child.config["url"]
    queue = child.config["queue"]
    dead = f"{queue}.dead"
    others = set(ids) - {poison}
    deaths = 0
    deadline = time.monotonic() + timeout
    proc = child.start()
    while True:
        # Settled: each message handled or dead-lettered, nothing ready any more (what the
        # assertions then check exactly; a message may be both, in the failure being hunted)
        handled = len(others & set(child.record().handled_ids()))
        if handled + ready_count(url, dead) >= len(ids) and ready_count(url, queue) == 0:
            break
        if proc.poll() is not None:
            assert proc.returncode == -signal.SIGKILL, (proc.returncode, child.errors()[-3000:])
            deaths += 1
            assert deaths <= max_restarts, f"still dying after {deaths} restarts"
            proc = child.start()
        if time.monotonic() > deadline:
            raise AssertionError(f"the crash loop did not settle in {timeout} s: {deaths} deaths")
        time.sleep(0.05)
    code, _ = child.terminate()
    assert code == 0, child.errors()[-3000:]
    return child.record(), deaths


def drain_all(url: str, queue: str) -> list[tuple[pika.spec.BasicProperties, bytes]]:
    """Take every ready message of ``queue`` (basic.get, acked)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    out: list[tuple[pika.spec.BasicProperties, bytes]] = []
    try:
        channel = connection.channel()
        while True:
            method, props, body = channel.basic_get(queue, auto_ack=True)
            if method is None:
                return out
            out.append((props, body))
    finally:
        connection.close()


#: the child's redelivery policy (a RetryPolicy's fields: JSON to the child)
QUICK_CONFIG = {"max_attempts": 3, "initial_delay": 0.1, "max_delay": 0.2, "jitter": 0.0}


def child_factories(tmp_path: Path) -> Iterator[Callable[..., ChildConsumer]]:
    """The body of a ``child_factory`` fixture: ``child_factory(url, queue, **config)`` makes a
    ChildConsumer whose processes die with the test; the consumer's own queues (dead letters,
    delay levels) are deleted after it."""
    made: list[ChildConsumer] = []

    def factory(url: str, queue: str, **config: Any) -> ChildConsumer:
        config.setdefault("redelivery", QUICK_CONFIG)
        place = tmp_path / f"child{len(made)}"
        place.mkdir()
        child = ChildConsumer(place, url, queue, **config)
        made.append(child)
        return child

    yield factory
    for child in made:
        child.close()
        delete_queues(child.config["url"], side_queues(child.config["queue"], QUICK))


CRASH_TOTAL = 30


def check_crash_loop(
    url: str, queue: str, child_factory: Callable[..., ChildConsumer], prefetch: int
) -> None:
    """A message whose handler kills the process, each time, on quorum queue ``queue``: with a
    supervisor restarting the consumer, it ends in ``<queue>.dead`` (the broker's
    x-delivery-count gives its attempt), the handler having run on it ``max_attempts`` times,
    and every other message is handled. Shared with tests/rabbitmq4 (its delivery-count rules)."""
    ids = [f"m{i:02d}" for i in range(CRASH_TOTAL)]
    poison = ids[5]
    fill(url, queue, ids)
    child = child_factory(url, queue, prefetch=prefetch, crash_on=poison)
    max_attempts = int(QUICK_CONFIG["max_attempts"])
    record, deaths = supervise_crash_loop(child, ids, poison, max_restarts=max_attempts + 2)
    dead = drain_all(url, f"{queue}.dead")
    assert [props.message_id for props, _ in dead] == [poison], (
        "dead-lettered besides the poison: "
        f"{[(p.message_id, p.headers.get('x-attempts')) for p, _ in dead]}"
    )
    assert record.started_ids()[poison] == max_attempts, record.started
    assert deaths == max_attempts
    assert set(record.handled_ids()) == set(ids) - {poison}
    headers = dead[0][0].headers
    assert headers["x-exception-type"] == "AttemptsExceeded", headers
    assert headers["x-attempts"] == max_attempts + 1
    assert headers["x-original-queue"] == queue
    assert ready_count(url, queue) == 0


@contextlib.contextmanager
def running(consumer: Consumer, handler: Callable[[Delivery], Any]) -> Iterator[None]:
    """``consumer.run(handler)`` on a thread for the block; stopped (and run()'s own error
    raised) at its end."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run(handler)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-consumer")
    thread.start()
    try:
        yield
    finally:
        consumer.stop()
        thread.join(60)
    assert not thread.is_alive(), "run() did not return after stop()"
    if errors:
        raise errors[0]


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "reliable_amqp" and r.levelno >= logging.WARNING
    ]
