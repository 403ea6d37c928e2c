"""Support for the inbox's consumer-level tests: duplicates in, child consumers running
``Inbox.handler`` (``inbox_child.py``), their record read back.

Waits are on events (lines in the record file, rows in a database, a queue count, a process
exit), each bounded; no fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from reliable_amqp import Publisher
from support.consumer import QUICK_CONFIG, record_lines

CHILD = Path(__file__).resolve().parents[1] / "inbox_consumer" / "inbox_child.py"


def publish_copies(url: str, queue: str, ids: list[str], lag: int = 25) -> int:
    """Publish each id twice with the same ``message_id`` (bodies ``a`` and ``b``, so the
    test can tell the copies apart): the second copy of id ``i`` follows the first copy of id
    ``i + lag``, so copies meet in one prefetch window and across kills. All confirmed."""
    order: list[tuple[str, str]] = []
    for i, message_id in enumerate(ids):
        order.append((message_id, "a"))
        if i >= lag:
            order.append((ids[i - lag], "b"))
    order.extend((message_id, "b") for message_id in ids[max(0, len(ids) - lag) :])
    with Publisher(url, max_in_flight=2000) as publisher:
        for message_id, copy in order:
            publisher.publish("", queue, copy.encode(), message_id=message_id)
        assert publisher.flush(timeout=120) == 0, "the test's messages were not all confirmed"
    assert len(order) == 2 * len(ids)
    return len(order)


class Record:
    """What the child consumers wrote to their shared record file."""

    def __init__(self, lines: list[str]) -> None:
        self.started: list[tuple[str, str, int, bool]] = []
        self.handled: list[tuple[str, str, int, bool]] = []
        self.exits: list[dict[str, Any]] = []
        #: (message_id, pid, started, returned): each call that returned, on one clock
        self.calls: list[tuple[str, int, float, float]] = []
        self.subscribed = 0
        began: dict[tuple[str, str, int], float] = {}
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind in ("S", "H"):
                message_id, body, attempt, redelivered, pid, at = rest.split(" ")
                row = (message_id, body, int(attempt), redelivered == "1")
                (self.started if kind == "S" else self.handled).append(row)
                call = (message_id, body, int(pid))
                if kind == "S":
                    began[call] = float(at)
                elif call in began:
                    self.calls.append((message_id, int(pid), began.pop(call), float(at)))
            elif kind == "SUBSCRIBED":
                self.subscribed += 1
            elif kind == "EXIT":
                self.exits.append(json.loads(rest))

    def handled_copies(self) -> set[tuple[str, str]]:
        """The (message_id, body) pairs the inbox handler returned for at least once."""
        return {(m, b) for m, b, _, _ in self.handled}

    def started_ids(self) -> Counter[str]:
        return Counter(m for m, _, _, _ in self.started)

    def handled_ids(self) -> Counter[str]:
        return Counter(m for m, _, _, _ in self.handled)

    def races(self) -> int:
        """Ids whose copies were in two processes' handlers at the same time (each in its own
        open transaction: the second claim waited for the first's commit)."""
        by_id: dict[str, list[tuple[int, float, float]]] = {}
        for message_id, pid, began, ended in self.calls:
            by_id.setdefault(message_id, []).append((pid, began, ended))
        raced = 0
        for calls in by_id.values():
            if any(
                p1 != p2 and b1 < e2 and b2 < e1
                for i, (p1, b1, e1) in enumerate(calls)
                for p2, b2, e2 in calls[i + 1 :]
            ):
                raced += 1
        return raced


class Children:
    """Child consumers (``inbox_child.py``) sharing one record file: one after another, or
    several at once."""

    def __init__(self, place: Path, **config: Any) -> None:
        place.mkdir(parents=True, exist_ok=True)
        self.out = place / "record.txt"
        self.out.touch()
        self.stderr = place / "stderr.txt"
        config.setdefault("redelivery", QUICK_CONFIG)
        self.config = {"out": str(self.out), **config}
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.procs[-1]

    def start(self, **overrides: Any) -> subprocess.Popen[bytes]:
        with open(self.stderr, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps({**self.config, **overrides})],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.procs.append(proc)
        return proc

    def record(self) -> Record:
        return Record(record_lines(self.out))

    def errors(self) -> str:
        return self.stderr.read_text(errors="replace")[-3000:] if self.stderr.exists() else ""

    def wait(self, predicate: Callable[[Record], bool], timeout: float, what: str) -> Record:
        """Wait until the record satisfies ``predicate``; fails at once when every child died."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.record()
            if predicate(record):
                return record
            if all(p.poll() is not None for p in self.procs):
                record = self.record()
                if predicate(record):
                    return record
                codes = [p.returncode for p in self.procs]
                raise AssertionError(f"the child consumers exited {codes} before {what}:\n"
                                     f"{self.errors()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n"
                                     f"{self.errors()}")  # fmt: skip
            time.sleep(0.02)

    def kill9(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        proc = proc or self.proc
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL

    def terminate(self, proc: subprocess.Popen[bytes] | None = None) -> int:
        """SIGTERM (a graceful stop: what finished is acked); the exit code."""
        proc = proc or self.proc
        proc.send_signal(signal.SIGTERM)
        return proc.wait(60)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def count_rows(connect: Callable[[], Any], sql: str, params: Iterable[Any] = ()) -> int:
    """One ``count(*)`` on a new connection of the test's database (closed after)."""
    from support.inbox import fetch

    conn = connect()
    try:
        rows = fetch(conn, sql, tuple(params))
        conn.commit()
        return int(rows[0][0])
    finally:
        conn.close()
