"""The processes of their own that ``benchmarks/outbox.py`` measures: ``outbox.py --child SPEC``
runs one (a relay, ``publish_many``, a writer, a LISTEN session); :class:`Child` starts it and
talks to it (ready, go, its one JSON line of results).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from outbox_harness import ROUTING_KEY, body, peak_kb, proc_kb

from reliable_amqp import Publisher
from reliable_amqp.outbox import Outbox, OutboxRelay

#: the script a child runs (``outbox.py --child SPEC``)
OUTBOX = Path(__file__).resolve().parent / "outbox.py"


# --- processes of their own -------------------------------------------------------------------


class Child:
    """``outbox.py`` run as ``--child SPEC``: it prepares, says "ready", waits for "go", works and
    prints one JSON line."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in result())
        self.proc = subprocess.Popen(
            [sys.executable, str(OUTBOX), "--child", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.ready_kb = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.proc.wait(10)
            raise RuntimeError(f"{self.spec['role']} did not start:\n{self._error()}")
        self.ready_kb = int(line.split()[1])

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def ask(self, line: str) -> dict[str, Any]:
        """Write ``line``; the JSON line the child answers."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer.strip():
            raise RuntimeError(f"{self.spec['role']}: no answer to {line!r}:\n{self._error()}")
        result: dict[str, Any] = json.loads(answer)
        return result

    def say(self, line: str) -> None:
        """Write ``line``, wait for the child's "ok"."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ok":
            raise RuntimeError(f"{self.spec['role']}: no answer to {line!r}:\n{self._error()}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)

    def result(self, timeout: float = 120) -> dict[str, Any]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"{self.spec['role']} did not finish:\n{self._error()}") from None
        if self.proc.returncode != 0 or not out.strip():
            raise RuntimeError(
                f"{self.spec['role']} exited {self.proc.returncode}:\n{self._error()}"
            )
        self._stderr.close()
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _error(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]


def child_main(spec: dict[str, Any]) -> int:
    role = spec["role"]
    if role == "relay":
        return child_relay(spec)
    if role == "publish-many":
        return child_publish_many(spec)
    if role == "writer":
        return child_writer(spec)
    if role == "listener":
        return child_listener(spec)
    raise SystemExit(f"unknown role {role!r}")


def _ready() -> None:
    print("ready", proc_kb(os.getpid()) or 0, flush=True)
    sys.stdin.readline()


def child_relay(spec: dict[str, Any]) -> int:
    # $OUTBOX_RELAY_MAX_IN_FLIGHT: the relay's window, else the relay's default (to compare
    # windows: the throughput a window costs, against the duplicates a kill -9 leaves)
    window = os.environ.get("OUTBOX_RELAY_MAX_IN_FLIGHT")
    relay = OutboxRelay(
        spec["db"],
        spec["url"],
        table=spec["table"],
        name=spec["name"],
        batch=spec.get("batch", 1000),
        poll_interval=spec.get("poll_interval", 1.0),
        **({"max_in_flight": int(window)} if window else {}),
    )
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    _ready()
    started, cpu = time.perf_counter(), time.process_time()
    relay.run(until_empty=spec["until_empty"])
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    result = {
        "seconds": seconds,
        "cpu": cpu,
        "hwm_kb": peak_kb(),
        "stats": asdict(relay.stats()),
    }
    print(json.dumps(result), flush=True)
    return 0


def child_publish_many(spec: dict[str, Any]) -> int:
    count, size = spec["count"], spec["size"]
    with Publisher(spec["url"]) as publisher:
        publisher.connect()
        _ready()
        started, cpu = time.perf_counter(), time.process_time()
        for start in range(0, count, 1000):
            bodies = [body(i, size) for i in range(start, min(count, start + 1000))]
            publisher.publish_many(spec["exchange"], ROUTING_KEY, bodies)  # futures dropped
        left = publisher.flush(None)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if left:
        raise RuntimeError(f"{left} messages not confirmed")
    print(json.dumps({"seconds": seconds, "cpu": cpu}), flush=True)
    return 0


def child_writer(spec: dict[str, Any]) -> int:
    """For each line on stdin (a JSON object: ``table``, ``notify``, ``seconds``), commit one
    add() a transaction as fast as it can for that long; one JSON line of figures each."""
    payload = body(0, spec["size"])
    with psycopg.connect(spec["db"], application_name=spec["name"]) as conn:
        print("ready 0", flush=True)
        for line in sys.stdin:
            if line.strip() == "go":
                continue
            task = json.loads(line)
            outbox = Outbox(task["table"], notify=task["notify"])
            count = 0
            started = time.perf_counter()
            deadline = started + task["seconds"]
            while time.perf_counter() < deadline:
                outbox.add(conn, spec["exchange"], ROUTING_KEY, payload)
                conn.commit()
                count += 1
            seconds = time.perf_counter() - started
            print(json.dumps({"count": count, "seconds": seconds}), flush=True)
    return 0


def child_listener(spec: dict[str, Any]) -> int:
    """LISTEN on the channels named on stdin (one a line, answered "ok" once listening), reading
    every notification, until stdin closes."""
    channels: queue.Queue[str | None] = queue.Queue()

    def commands() -> None:
        for line in sys.stdin:
            channels.put(line.strip())
        channels.put(None)

    count = 0
    with psycopg.connect(spec["db"], autocommit=True) as conn:
        print("ready 0", flush=True)
        threading.Thread(target=commands, daemon=True).start()
        while True:
            with contextlib.suppress(queue.Empty):
                channel = channels.get_nowait()
                if channel is None:
                    break
                if channel != "go":
                    conn.execute(f'LISTEN "{channel}"')
                    print("ok", flush=True)
            for _ in conn.notifies(timeout=0.05):
                count += 1
    print(json.dumps({"notifications": count}), flush=True)
    return 0
