"""The transactional outbox (issue 29): the relay against publish_many, its memory, the latency
of an idle relay, what add() costs a writer, NOTIFY and the writers' commits, two relays.

    bash scripts/dev.sh run python benchmarks/outbox.py                     # 1,000,000-row backlog
    bash scripts/dev.sh run python benchmarks/outbox.py --backlog 200000    # quicker
    bash scripts/dev.sh run python benchmarks/outbox.py --only latency,writer --json
    bash scripts/dev.sh run python benchmarks/outbox.py --only mariadb,stacks
    bash scripts/dev.sh run python benchmarks/outbox.py --quick             # seconds, tiny sizes

Everything runs against the real PostgreSQL ($OUTBOX_PG, default postgresql://postgres@127.0.0.1:
5432; a database of its own, dropped after) and the local broker ($AMQP_URL). Messages go to a
durable direct exchange of the run's own; each measured row binds a fresh durable lazy queue to
it (the broker keeps the backlog on its disk), deleted after. Bodies are ``--size`` bytes
(default 200), persistent, mandatory.

- **drain**: ``--backlog`` rows are written once through ``Outbox.add_many`` (10,000 a
  transaction; its rate is reported) into a template table, copied into a fresh outbox table,
  and drained by one relay in a process of its own (``OutboxRelay.run(until_empty=True)``); the
  same messages are published by ``Publisher.publish_many`` (1,000 a call) in a process of its
  own. Both are timed the same way, from the "go" given to the ready process to the moment the
  queue holds every message (passive declares every 20 ms). Client CPU per message is the
  process's ``time.process_time()`` over its run; the PostgreSQL backends' (the relay's two
  sessions, found through pg_stat_activity) and the broker's (``beam.smp``) from /proc; the
  machine's busy share of its cores from /proc/stat. The broker's ceiling (raw_ceiling.py:
  pre-encoded frames, no client work) closes the table.
- **rss**: the relay's resident memory, sampled every 20 ms from /proc/PID/status (VmRSS), at
  a ``--small-backlog`` (default a tenth of ``--backlog``) and at ``--backlog`` (the drain's).
- **relays**: two relays (two processes) against one on the same ``--backlog`` rows.
- **latency**: an idle relay, and writer threads committing ``--rate`` transactions a second
  (one ``add()`` each) for ``--latency-seconds``: commit-to-confirm as the relay measures it
  (``relay.stats()``: from the row's ``created_at``, stamped in ``add()``, to the relay taking
  the broker's confirm) and commit-to-delivery as a consumer of the queue sees it (from
  ``commit()`` returning in the writer to the delivery, by message id). With NOTIFY, and without
  (the relay then finds rows by polling, every ``poll_interval``: 1 s).
- **writer**: one connection, ``add()`` against a plain INSERT of the same row (the same columns
  and values, prepared), NOTIFY on and off, one row and 100 rows a transaction.
- **commits**: 1 and ``--writers`` writer processes committing one ``add()`` a transaction as
  fast as they can for ``--commit-seconds``, NOTIFY on and off (a LISTEN session open, as an
  idle relay's is), two rounds interleaved: whether NOTIFY's lock at commit serialises the
  writers, seen in their commit rate and, directly, in how often their sessions wait for that
  lock (pg_stat_activity sampled every 10 ms).
- **sqlite**, **mariadb**: a ``--sqlite-backlog`` drained from a SQLite file, and a
  ``--mariadb-backlog`` from MariaDB ($OUTBOX_MYSQL, default mysql://root@127.0.0.1:3306; a
  database of its own, dropped after) through PyMySQL, each written through
  ``Outbox.add_many`` and drained as the drain section's row is (the same code), against
  ``publish_many`` of the same number of messages in the same run (measured once for each
  number and shared by the rows of that size). MariaDB's CPU is the whole ``mariadbd``
  process's (its performance_schema is off: no CPU per session), other sessions' work included.
- **stacks**: the writer on each application stack (psycopg, SQLAlchemy ``Session`` over
  psycopg, ``AsyncSession`` over asyncpg, a bare asyncpg connection, Django's
  ``transaction.atomic()``, all on PostgreSQL; PyMySQL on MariaDB; sqlite3): ``--writer-txns``
  transactions of one ``add()`` each against as many of a plain INSERT of the same row (the same
  columns and values, a fresh message id and time) through the same connection in the same
  transaction shape, in rounds interleaved; the extra client CPU a row (``time.process_time``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import queue
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import pika
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from broker_idle import broker_pids, wait_idle
from raw_ceiling import raw_confirmed_seconds

from reliable_amqp import Publisher
from reliable_amqp.outbox import AsyncOutbox, Outbox, OutboxRelay, status
from reliable_amqp.outbox._rows import row_values
from reliable_amqp.outbox._schema import WRITE_COLUMNS, mysql_columns, mysql_quote

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
PG = os.environ.get("OUTBOX_PG", "postgresql://postgres@127.0.0.1:5432")
MYSQL = os.environ.get("OUTBOX_MYSQL", "mysql://root@127.0.0.1:3306")
SECTIONS = ("drain", "rss", "relays", "latency", "writer", "commits", "sqlite", "mariadb", "stacks")
ROUTING_KEY = "bench"
TICKS = os.sysconf("SC_CLK_TCK")

Row = dict[str, Any]


def body(i: int, size: int) -> bytes:
    """The ``i``-th message's body: its number, then padding."""
    head = b"%012d" % i
    return head + b"x" * (size - len(head))


# --- /proc ------------------------------------------------------------------------------------


def proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def proc_kb(pid: int, key: str = "VmRSS") -> int | None:
    """A /proc/PID/status figure in kB (VmRSS, VmHWM), None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status_file:
            for line in status_file:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def listener_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` (/proc/net/tcp and tcp6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


#: the broker whose CPU is measured (main() sets it to --url) and its pid, once found
BROKER = {"url": URL}
_BROKER_PID: list[int | None] = []


def port_owner(port: int, pids: Sequence[int] | None = None) -> int | None:
    """The process of ``pids`` (default: every process) listening on TCP ``port``, None when
    none is (the server is not on this machine, or not visible from here)."""
    inodes = listener_inodes(port)
    if pids is None:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    for pid in pids:
        with contextlib.suppress(OSError):
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            if any(f"socket:[{inode}]" in links for inode in inodes):
                return pid
    return None


def broker_pid() -> int | None:
    """The local broker's ``beam.smp``: the one listening on the broker URL's port (another
    node may run beside it), None when it is not on this machine."""
    if not _BROKER_PID:
        pids = broker_pids()
        found = port_owner(pika.URLParameters(BROKER["url"]).port, pids)
        _BROKER_PID.append(found if found is not None or len(pids) != 1 else pids[0])
    return _BROKER_PID[0]


def broker_cpu() -> float | None:
    """CPU seconds of the local broker (see :func:`broker_pid`), None when not known."""
    pid = broker_pid()
    return None if pid is None else proc_cpu(pid)


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of every core so far (/proc/stat; idle and iowait are not busy)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


# --- the broker -------------------------------------------------------------------------------


class Broker:
    """The run's exchange, and the fresh queue bound to it for each measured row."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.exchange = f"ra-bench-outbox-{uuid.uuid4().hex[:8]}"
        with self.channel() as channel:
            channel.exchange_declare(self.exchange, "direct", durable=True)

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            yield connection.channel()
        finally:
            connection.close()

    @contextlib.contextmanager
    def queue(self, bind: bool = True) -> Iterator[str]:
        """A new durable lazy queue bound to the exchange (with ``bind``), deleted after."""
        name = f"ra-bench-outbox-{uuid.uuid4().hex[:10]}"
        with self.channel() as channel:
            channel.queue_declare(name, durable=True, arguments={"x-queue-mode": "lazy"})
            if bind:
                channel.queue_bind(name, self.exchange, ROUTING_KEY)
        try:
            yield name
        finally:
            with self.channel() as channel:
                channel.queue_delete(name)

    def close(self) -> None:
        with self.channel() as channel:
            channel.exchange_delete(self.exchange)


# --- the database -----------------------------------------------------------------------------


class Database:
    """A database of the run's own, dropped at close()."""

    def __init__(self, base: str, checkpoint: bool = True) -> None:
        self.base = base
        self.checkpoint = checkpoint
        self.name = f"ra_bench_outbox_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {self.name}")
        self.dsn = f"{base}/{self.name}"
        self._tables = 0

    def connect(self, autocommit: bool = False) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=autocommit)

    def table(self) -> str:
        """A new outbox table (installed); its name."""
        self._tables += 1
        name = f"bench_{self._tables}"
        with self.connect() as conn:  # commits at the end of the block
            Outbox(name).install(conn)
        return name

    def drop(self, table: str) -> None:
        with self.connect(autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_failed")

    def settle(self, table: str) -> None:
        """What an outbox that filled over time would have had: vacuumed, analysed, and no
        checkpoint's worth of dirty pages left for the measured row to pay for."""
        with self.connect(autocommit=True) as conn:
            conn.execute(f"VACUUM (ANALYZE) {table}")
            if self.checkpoint:  # not with --quick: a shared server's checkpoint takes a while
                conn.execute("CHECKPOINT")

    def close(self) -> None:
        with psycopg.connect(f"{self.base}/postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


class MariaDB:
    """A MariaDB database of the run's own (PyMySQL), dropped at close()."""

    def __init__(self, base: str) -> None:
        url = urlsplit(base)
        self.options: dict[str, Any] = {
            "host": url.hostname or "127.0.0.1", "port": url.port or 3306,
            "user": url.username or "root", "password": url.password or "",
        }  # fmt: skip
        self.name = f"ra_bench_outbox_{uuid.uuid4().hex[:10]}"
        with self._admin() as admin, admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {self.name} CHARACTER SET utf8mb4")
        self.dsn = f"{base}/{self.name}"

    def _admin(self) -> Any:
        import pymysql

        return pymysql.connect(**self.options, autocommit=True)

    def connect(self) -> Any:
        """A PyMySQL connection to the database (autocommit off, PyMySQL's default)."""
        import pymysql

        return pymysql.connect(**self.options, database=self.name)

    def version(self) -> str:
        with self._admin() as admin, admin.cursor() as cursor:
            cursor.execute("SELECT version()")
            return str(cursor.fetchone()[0]).split("-")[0]

    def close(self) -> None:
        with self._admin() as admin, admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {self.name}")


COLUMNS = ", ".join(WRITE_COLUMNS)
#: a row's placeholders in psycopg's, Django's and PyMySQL's style
PERCENT_MARKS = ["%s"] * len(WRITE_COLUMNS)


def insert_sql(table: str, marks: Sequence[str], columns: str = COLUMNS) -> str:
    """A plain INSERT of one outbox row, its values in ``marks`` (the driver's placeholders)."""
    return f"INSERT INTO {table} ({columns}) VALUES ({', '.join(marks)})"


def plain_values(exchange: str, payload: bytes) -> Callable[[], list[Any]]:
    """The values of the row ``add()`` writes for ``payload`` (:data:`WRITE_COLUMNS`), with a
    fresh message id and time at each call: what a plain INSERT of the same row writes."""
    template = list(row_values(exchange, ROUTING_KEY, payload, properties={}))

    def values() -> list[Any]:
        template[0] = uuid.uuid4().hex
        template[-1] = time.time()
        return template

    return values


def write_backlog(conn: Any, outbox: Outbox, exchange: str, count: int, size: int) -> Row:
    """``count`` rows through Outbox.add_many on ``conn`` (psycopg, sqlite3, PyMySQL), 10,000 a
    transaction; the rate it wrote at and its client CPU a row."""
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, count, 10_000):
        outbox.add_many(conn, [
            {"exchange": exchange, "routing_key": ROUTING_KEY, "body": body(i, size)}
            for i in range(start, min(count, start + 10_000))
        ])  # fmt: skip
        conn.commit()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"msgs": count, "rate": count / seconds, "cpu_us": cpu / count * 1e6}


def fill_template(db: Database, exchange: str, count: int, size: int) -> Row:
    """``count`` rows through Outbox.add_many, 10,000 a transaction; the rate it wrote at."""
    table = db.table()
    with db.connect() as conn:
        return {"table": table, **write_backlog(conn, Outbox(table), exchange, count, size)}


def copy_backlog(db: Database, template: str, count: int) -> str:
    """A new outbox table holding the template's first ``count`` rows (their order kept)."""
    table = db.table()
    with db.connect() as conn:
        conn.execute(
            f"INSERT INTO {table} ({COLUMNS}) SELECT {COLUMNS} FROM {template}"
            " ORDER BY id LIMIT %s",
            (count,),
        )
        conn.commit()
    db.settle(table)
    return table


# --- processes of their own -------------------------------------------------------------------


class Child:
    """This script run as ``--child SPEC``: it prepares, says "ready", waits for "go", works and
    prints one JSON line."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._stderr: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed in result())
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec)],
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
    relay = OutboxRelay(
        spec["db"],
        spec["url"],
        table=spec["table"],
        name=spec["name"],
        batch=spec.get("batch", 1000),
        poll_interval=spec.get("poll_interval", 1.0),
    )
    signal.signal(signal.SIGTERM, lambda *_: relay.stop())
    _ready()
    started, cpu = time.perf_counter(), time.process_time()
    relay.run(until_empty=spec["until_empty"])
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    result = {
        "seconds": seconds,
        "cpu": cpu,
        "hwm_kb": proc_kb(os.getpid(), "VmHWM"),
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


# --- watching a measured run ------------------------------------------------------------------


@dataclass
class Watched:
    """What :class:`Watch` saw from "go" on."""

    #: seconds from "go" until the queue held every message (None: it never did)
    seconds: float | None = None
    depth: int = 0
    #: peak VmRSS of each watched process, kB
    peak_kb: dict[int, int] = field(default_factory=dict)
    #: CPU seconds of the database server: the PostgreSQL backends of the watched relays, or
    #: the whole server process watched (MariaDB's); None: none found
    backend_cpu: float | None = None
    broker_cpu: float | None = None
    #: the machine's busy share of all its cores (0..1)
    machine_busy: float = 0.0
    #: (seconds since "go", queue depth), every 20 ms until full
    depths: list[tuple[float, int]] = field(default_factory=list)

    def halves(self, count: int) -> tuple[float, float]:
        """Messages a second while the queue took its first half, and its second half."""
        half = next((t for t, d in self.depths if d >= count // 2), None)
        if half is None or self.seconds is None or not 0 < half < self.seconds:
            return float("nan"), float("nan")
        return (count // 2) / half, (count - count // 2) / (self.seconds - half)


class Watch:
    """From :meth:`start` (the "go"), in a thread: the queue's depth every 20 ms until it holds
    ``target`` messages, the watched processes' RSS, and the CPU of the PostgreSQL backends whose
    application_name starts with one of ``relay_names`` (the relays' sessions) or else of the
    database server process ``server_pid``."""

    def __init__(
        self,
        url: str,
        queue: str,
        target: int,
        pids: Sequence[int],
        *,
        relay_names: Sequence[str] = (),
        server_pid: int | None = None,
        timeout: float = 600,
    ) -> None:
        self.url, self.queue, self.target, self.timeout = url, queue, target, timeout
        self.pids = list(pids)
        self.relay_names = list(relay_names)
        self.server_pid = server_pid
        self.result = Watched()
        self.full = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._backends: dict[int, float] = {}  # pid -> its CPU seconds, last seen

    def start(self) -> None:
        self._started = time.perf_counter()
        self._broker = broker_cpu()
        self._server = None if self.server_pid is None else proc_cpu(self.server_pid)
        self._machine = machine_ticks()
        self._thread.start()

    def wait_full(self) -> float:
        if not self.full.wait(self.timeout):
            raise RuntimeError(
                f"the queue holds {self.result.depth:,} of {self.target:,} after {self.timeout} s"
            )
        assert self.result.seconds is not None
        return self.result.seconds

    def finish(self) -> Watched:
        """Stop watching (once the watched processes are gone)."""
        self._stop.set()
        self._thread.join()
        broker = broker_cpu()
        if broker is not None and self._broker is not None:
            self.result.broker_cpu = broker - self._broker
        busy, total = machine_ticks()
        if total > self._machine[1]:
            self.result.machine_busy = (busy - self._machine[0]) / (total - self._machine[1])
        if self._backends:
            self.result.backend_cpu = sum(self._backends.values())
        server = None if self.server_pid is None else proc_cpu(self.server_pid)
        if server is not None and self._server is not None:
            self.result.backend_cpu = server - self._server
        return self.result

    def _run(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        channel = connection.channel()
        pg = psycopg.connect(f"{PG}/postgres", autocommit=True) if self.relay_names else None
        tick = 0
        try:
            while not self._stop.is_set():
                if not self.full.is_set():
                    depth = channel.queue_declare(self.queue, passive=True).method.message_count
                    self.result.depth = depth
                    self.result.depths.append((time.perf_counter() - self._started, depth))
                    if depth >= self.target:
                        self.result.seconds = time.perf_counter() - self._started
                        self.full.set()
                for pid in self.pids:
                    kb = proc_kb(pid)
                    if kb is not None and kb > self.result.peak_kb.get(pid, 0):
                        self.result.peak_kb[pid] = kb
                if pg is not None:
                    if tick % 5 == 0:
                        self._find_backends(pg)
                    self._sample_backends()
                tick += 1
                self._stop.wait(0.02)
        finally:
            connection.close()
            if pg is not None:
                pg.close()

    def _find_backends(self, pg: psycopg.Connection[Any]) -> None:
        """The relays' sessions: new processes since "go" (the relays connect in ``run()``),
        so all of their CPU is the relays' work."""
        for (pid,) in pg.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE ANY(%s)",
            ([f"reliable-amqp relay {name}%" for name in self.relay_names],),
        ).fetchall():
            self._backends.setdefault(pid, 0.0)

    def _sample_backends(self) -> None:
        for pid in self._backends:
            cpu = proc_cpu(pid)
            if cpu is not None:
                self._backends[pid] = cpu


def unique_name(role: str) -> str:
    return f"bench-{role}-{uuid.uuid4().hex[:6]}"


def measured(
    url: str,
    queue: str,
    count: int,
    children: list[Child],
    *,
    relay_names: Sequence[str] = (),
    server_pid: int | None = None,
    stop_when_full: bool = False,
) -> tuple[Watched, list[dict[str, Any]]]:
    """Start ``children`` together and watch until the queue holds ``count`` messages; then
    stop them (``stop_when_full``) or let them end on their own; their results."""
    try:
        for child in children:
            child.wait_ready()
        watch = Watch(url, queue, count, [c.pid for c in children], relay_names=relay_names,
                      server_pid=server_pid)  # fmt: skip
        watch.start()
        for child in children:
            child.go()
        watch.wait_full()
        if stop_when_full:
            for child in children:
                child.stop()
        results = [child.result() for child in children]
    finally:
        for child in children:
            child.kill()
    watched = watch.finish()
    return watched, results


def relay_spec(db: str, url: str, table: str, **extra: Any) -> dict[str, Any]:
    return {"role": "relay", "db": db, "url": url, "table": table, "name": unique_name("relay"),
            "until_empty": True, **extra}  # fmt: skip


# --- the sections -----------------------------------------------------------------------------


@dataclass
class Context:
    args: argparse.Namespace
    db: Database
    broker: Broker
    template: str = ""
    template_rows: int = 0
    fill: Row = field(default_factory=dict)
    results: dict[str, list[Row]] = field(default_factory=dict)
    #: /proc/loadavg when the run started (other work on a shared machine shows here)
    load: str = ""
    took: dict[str, int] = field(default_factory=dict)
    #: the LISTEN session of the writer sections (see :func:`listening`)
    listener: Child | None = None
    #: the run's MariaDB database (see :meth:`mariadb`)
    maria: MariaDB | None = None
    #: publish_many's row for each number of messages measured (see :meth:`publish_many`)
    publish_many_rows: dict[int, Row] = field(default_factory=dict)

    def mariadb(self) -> MariaDB:
        """The run's MariaDB database, made at first use (main() drops it)."""
        if self.maria is None:
            self.maria = MariaDB(MYSQL)
        return self.maria

    def publish_many(self, count: int) -> Row:
        """``Publisher.publish_many`` of ``count`` messages, measured once in the run for each
        count: the row every drain of that many messages is set against."""
        if count not in self.publish_many_rows:
            self.publish_many_rows[count] = publish_many_row(self, count)
        return self.publish_many_rows[count]

    def backlog(self, count: int) -> str:
        """A fresh outbox table holding ``count`` rows (the template written once, as needed)."""
        if self.template_rows < count:
            if self.template:
                self.db.drop(self.template)
            print(f"  writing {count:,} rows through Outbox.add_many ...", file=sys.stderr)
            self.fill = fill_template(self.db, self.broker.exchange, count, self.args.size)
            self.template, self.template_rows = self.fill["table"], count
        return copy_backlog(self.db, self.template, count)


def drain_row(ctx: Context, name: str, count: int, *, relays: int = 1, db: str | None = None,
              table: str | None = None) -> Row:  # fmt: skip
    """``relays`` relay processes drain ``table`` (``count`` rows) of ``db`` (default: the
    run's PostgreSQL database, the rows copied from the template) into a fresh queue."""
    dsn = db or ctx.db.dsn
    table = table or ctx.backlog(count)
    specs = [relay_spec(dsn, ctx.args.url, table, until_empty=relays == 1) for _ in range(relays)]
    # the database's CPU: the relays' PostgreSQL backends, or MariaDB's whole server process
    names = [s["name"] for s in specs] if dsn.startswith("postgresql") else []
    server = port_owner(urlsplit(dsn).port or 3306) if dsn.startswith("mysql") else None
    wait_idle()
    with ctx.broker.queue() as queue:
        children = [Child(spec) for spec in specs]
        watched, results = measured(
            ctx.args.url, queue, count, children, relay_names=names, server_pid=server,
            stop_when_full=relays > 1,
        )  # fmt: skip
        depth = watched.depth
    left = status(dsn, table)
    if db is None:
        ctx.db.drop(table)
    if left.pending or left.failed:
        raise RuntimeError(f"{name}: {left.pending} rows pending, {left.failed} failed after it")
    seconds = watched.seconds or 0.0
    cpu = sum(r["cpu"] for r in results)
    return {
        "name": name,
        "msgs": count,
        "seconds": seconds,
        "rate": count / seconds,
        "cpu_us": cpu / count * 1e6,
        "backend_cpu_us": None
        if watched.backend_cpu is None
        else watched.backend_cpu / count * 1e6,
        "broker_cpu_us": None if watched.broker_cpu is None else watched.broker_cpu / count * 1e6,
        "broker_cores": None if watched.broker_cpu is None else watched.broker_cpu / seconds,
        "machine_busy": watched.machine_busy,
        "rss_ready_mb": max(c.ready_kb for c in children) / 1024,
        "rss_peak_mb": max(watched.peak_kb.values(), default=0) / 1024,
        "rss_hwm_mb": max(r["hwm_kb"] or 0 for r in results) / 1024,
        "published": [r["stats"]["published"] for r in results],
        "extra_in_queue": depth - count,
        "halves": watched.halves(count),
    }


def publish_many_row(ctx: Context, count: int) -> Row:
    wait_idle()
    with ctx.broker.queue() as queue:
        spec = {"role": "publish-many", "url": ctx.args.url, "exchange": ctx.broker.exchange,
                "count": count, "size": ctx.args.size}  # fmt: skip
        child = Child(spec)
        watched, (result,) = measured(ctx.args.url, queue, count, [child])
    seconds = watched.seconds or 0.0
    return {
        "name": "Publisher.publish_many (1,000 a call)",
        "msgs": count,
        "seconds": seconds,
        "rate": count / seconds,
        "cpu_us": result["cpu"] / count * 1e6,
        "backend_cpu_us": None,
        "broker_cpu_us": None if watched.broker_cpu is None else watched.broker_cpu / count * 1e6,
        "broker_cores": None if watched.broker_cpu is None else watched.broker_cpu / seconds,
        "machine_busy": watched.machine_busy,
        "rss_peak_mb": max(watched.peak_kb.values(), default=0) / 1024,
        "halves": watched.halves(count),
    }


def ceiling_row(ctx: Context, count: int) -> Row:
    wait_idle()
    with ctx.broker.queue(bind=False) as queue:
        broker, machine = broker_cpu(), machine_ticks()
        seconds = raw_confirmed_seconds(
            ctx.args.url, queue, count, body(0, ctx.args.size), window=10_000
        )
        after, (busy, total) = broker_cpu(), machine_ticks()
    used = None if broker is None or after is None else after - broker
    return {
        "name": "raw frames, no client work (broker ceiling)",
        "msgs": count,
        "seconds": seconds,
        "rate": count / seconds,
        "cpu_us": None,
        "backend_cpu_us": None,
        "broker_cpu_us": None if used is None else used / count * 1e6,
        "broker_cores": None if used is None else used / seconds,
        "machine_busy": (busy - machine[0]) / max(1, total - machine[1]),
    }


def section_drain(ctx: Context) -> None:
    n = ctx.args.backlog
    plain = ctx.publish_many(n)
    relay = drain_row(ctx, f"OutboxRelay, 1 process, PostgreSQL backlog of {n:,}", n)
    relay["vs_publish_many"] = relay["rate"] / plain["rate"]
    ceiling = ceiling_row(ctx, min(n, ctx.args.ceiling_count))
    fill = {"name": "Outbox.add_many (10,000 a transaction): the backlog written", "msgs": n,
            "rate": ctx.fill["rate"], "cpu_us": ctx.fill["cpu_us"]}  # fmt: skip
    ctx.results["drain"] = [plain, relay, ceiling, fill]


def section_rss(ctx: Context) -> None:
    small = ctx.args.small_backlog or ctx.args.backlog // 10
    rows = [drain_row(ctx, f"OutboxRelay, backlog of {small:,}", small)]
    big = next(
        (r for r in ctx.results.get("drain", []) if r["name"].startswith("OutboxRelay")), None
    )
    if big is None:
        big = drain_row(ctx, f"OutboxRelay, backlog of {ctx.args.backlog:,}", ctx.args.backlog)
    rows.append(big)
    ctx.results["rss"] = [
        {"name": r["name"], "msgs": r["msgs"], "rss_ready_mb": r["rss_ready_mb"],
         "rss_peak_mb": r["rss_peak_mb"], "rss_hwm_mb": r["rss_hwm_mb"]}
        for r in rows
    ]  # fmt: skip


def section_relays(ctx: Context) -> None:
    n = ctx.args.backlog
    one = next(
        (r for r in ctx.results.get("drain", []) if r["name"].startswith("OutboxRelay")), None
    )
    if one is None:
        one = drain_row(ctx, f"OutboxRelay, 1 process, PostgreSQL backlog of {n:,}", n)
    two = drain_row(ctx, f"OutboxRelay, 2 processes, PostgreSQL backlog of {n:,}", n, relays=2)
    two["vs_one"] = two["rate"] / one["rate"]
    ctx.results["relays"] = [one, two]


def section_latency(ctx: Context) -> None:
    rows = [latency_row(ctx, notify=True, seconds=ctx.args.latency_seconds)]
    # without NOTIFY the relay only polls (every second): a shorter run shows it
    rows.append(latency_row(ctx, notify=False, seconds=max(1.0, ctx.args.latency_seconds / 2)))
    ctx.results["latency"] = rows


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def latency_row(ctx: Context, *, notify: bool, seconds: float) -> Row:
    args = ctx.args
    table = ctx.db.table()
    outbox = Outbox(table, notify=notify)
    commits: dict[str, float] = {}
    durations: list[float] = []
    arrivals: dict[str, float] = {}
    wait_idle()
    with ctx.broker.queue() as queue:
        spec = relay_spec(ctx.db.dsn, args.url, table, until_empty=False)
        relay = Child(spec)
        try:
            relay.wait_ready()
            relay.go()
            _wait_for_relay(ctx.db.dsn, table)
            consumer = Consumer(args.url, queue, arrivals)
            consumer.start()
            payload = body(0, args.size)
            writers = [
                threading.Thread(target=_paced_writer, args=(
                    ctx.db, outbox, ctx.broker.exchange, payload, args.rate / args.latency_writers,
                    seconds, i / args.rate, commits, durations,
                ))
                for i in range(args.latency_writers)
            ]  # fmt: skip
            for writer in writers:
                writer.start()
            for writer in writers:
                writer.join()
            consumer.wait_for(len(commits), timeout=30)
            consumer.stop()
            relay.stop()
            result = relay.result()
        finally:
            relay.kill()
    ctx.db.drop(table)
    delivered = [arrivals[m] - commits[m] for m in commits if m in arrivals]
    stats = result["stats"]
    return {
        "name": f"idle relay, NOTIFY {'on' if notify else 'off (polls every 1 s)'}",
        "commits": len(commits),
        "commit_rate": len(commits) / seconds,
        "confirm_p50_ms": (stats["latency_p50_s"] or float("nan")) * 1000,
        "confirm_p99_ms": (stats["latency_p99_s"] or float("nan")) * 1000,
        "delivered": len(delivered),
        "delivery_p50_ms": percentile(delivered, 0.5) * 1000,
        "delivery_p99_ms": percentile(delivered, 0.99) * 1000,
        "commit_p50_ms": percentile(durations, 0.5) * 1000,
        "commit_p99_ms": percentile(durations, 0.99) * 1000,
        "relay_cpu_pct": result["cpu"] / result["seconds"] * 100,
        "relay_cpu_us": result["cpu"] / max(1, len(commits)) * 1e6,
    }


def _wait_for_relay(dsn: str, table: str, timeout: float = 15) -> None:
    """Until the relay owns every partition (an idle relay, ready for the writers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        relays = status(dsn, table).relays
        if relays and relays[0].partitions == 64:
            time.sleep(0.3)  # its LISTEN session, started after
            return
        time.sleep(0.05)
    raise RuntimeError("the relay did not take its partitions")


def _paced_writer(  # noqa: PLR0917  (a thread's arguments)
    db: Database,
    outbox: Outbox,
    exchange: str,
    payload: bytes,
    rate: float,
    seconds: float,
    offset: float,
    commits: dict[str, float],
    durations: list[float],
) -> None:
    """One add() a transaction, ``rate`` a second, for ``seconds``; the commit times by id, and
    how long each took from add() to commit() returning."""
    with db.connect() as conn:
        started = time.perf_counter() + offset
        n = 0
        while True:
            due = started + n / rate
            if due - started >= seconds:
                return
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            before = time.time()
            message_id = outbox.add(conn, exchange, ROUTING_KEY, payload)
            conn.commit()
            commits[message_id] = after = time.time()
            durations.append(after - before)
            n += 1


class Consumer:
    """Reads a queue in a thread, noting when each message id arrived."""

    def __init__(self, url: str, queue: str, arrivals: dict[str, float]) -> None:
        self.url, self.queue, self.arrivals = url, queue, arrivals
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1000)
        try:
            for method, props, _data in channel.consume(
                self.queue, auto_ack=True, inactivity_timeout=0.1
            ):
                if method is not None:
                    self.arrivals[props.message_id] = time.time()
                if self._stop.is_set():
                    break
            channel.cancel()
        finally:
            connection.close()


WRITERS = ("Outbox.add(), NOTIFY on", "Outbox.add(), NOTIFY off", "plain INSERT")
#: the writer rows run in this many rounds, interleaved, and report their medians (other work
#: on a shared machine comes and goes: each row gets its share of it)
ROUNDS = 4


def section_writer(ctx: Context) -> None:
    args = ctx.args
    rows: list[Row] = []
    for per_txn, txns in ((1, args.writer_txns), (100, max(1, args.writer_txns // 10))):
        with contextlib.ExitStack() as stack:
            writes = {name: stack.enter_context(writer(ctx, name)) for name in WRITERS}
            rounds: dict[str, list[Row]] = {name: [] for name in WRITERS}
            for _ in range(ROUNDS):
                for name, write in writes.items():
                    rounds[name].append(timed_writes(write, per_txn, max(1, txns // ROUNDS)))
        for name in WRITERS:
            figures = rounds[name]
            row: Row = {
                "name": name,
                "rows_per_txn": per_txn,
                "txns": sum(f["txns"] for f in figures),
            }
            for key in ("statement_us", "total_us", "cpu_us", "txn_rate"):
                row[key] = statistics.median(f[key] for f in figures)
            rows.append(row)
        plain = rows[-1]
        for row in rows[-len(WRITERS) :]:
            row["extra_us_per_row"] = row["statement_us"] - plain["statement_us"]
    ctx.results["writer"] = rows


@dataclass
class Writer:
    """One row a ``write()``, on a connection (and a table) of its own; ``commit()``."""

    write: Callable[[], None]
    commit: Callable[[], None]


@contextlib.contextmanager
def writer(ctx: Context, name: str) -> Iterator[Writer]:
    """The writer of the row ``name`` (:data:`WRITERS`), with a session LISTENing on its
    table's channel as an idle relay's is."""
    table = ctx.db.table()
    exchange, payload = ctx.broker.exchange, body(0, ctx.args.size)
    outbox = Outbox(table, notify=name.endswith("NOTIFY on"))
    values, insert = plain_values(exchange, payload), insert_sql(table, PERCENT_MARKS)
    with ctx.db.connect() as conn, listening(ctx, table):

        def plain() -> None:
            conn.execute(insert, values(), prepare=True)

        def add() -> None:
            outbox.add(conn, exchange, ROUTING_KEY, payload)

        result = Writer(plain if name == "plain INSERT" else add, conn.commit)
        for _ in range(min(50, ctx.args.writer_txns)):  # warm: prepared statements, caches
            result.write()
            result.commit()
        yield result
    ctx.db.drop(table)


@contextlib.contextmanager
def listening(ctx: Context, table: str) -> Iterator[None]:
    """A session LISTENing on the outbox's channel and reading what comes, as an idle relay's
    does: in a process of its own (its work is not the writer's), one for the whole run."""
    if ctx.listener is None:
        ctx.listener = Child({"role": "listener", "db": ctx.db.dsn})
        ctx.listener.wait_ready()
    ctx.listener.say(table)
    yield


def timed_writes(writer: Writer, per_txn: int, txns: int) -> Row:
    """``txns`` transactions of ``per_txn`` rows."""
    clock, write, commit = time.perf_counter, writer.write, writer.commit
    in_statements = 0.0
    started, cpu = clock(), time.process_time()
    for _ in range(txns):
        before = clock()
        for _ in range(per_txn):
            write()
        in_statements += clock() - before
        commit()
    seconds, cpu = clock() - started, time.process_time() - cpu
    rows = txns * per_txn
    return {
        "txns": txns,
        "statement_us": in_statements / rows * 1e6,
        "total_us": seconds / rows * 1e6,
        "cpu_us": cpu / rows * 1e6,
        "txn_rate": txns / seconds,
    }


#: the commits rows run in this many rounds, interleaved (NOTIFY off, on, off, on...)
COMMIT_ROUNDS = 2


def section_commits(ctx: Context) -> None:
    args = ctx.args
    plan = [(writers, notify) for writers in sorted({1, args.writers}) for notify in (False, True)]
    prefix = unique_name("writer")
    # the writer processes start once and serve every row (the first one alone, then all)
    children = [
        Child({"role": "writer", "db": ctx.db.dsn, "name": f"{prefix}-{i}", "size": args.size,
               "exchange": ctx.broker.exchange})
        for i in range(max(1, args.writers))
    ]  # fmt: skip
    runs: dict[tuple[int, bool], list[Row]] = {key: [] for key in plan}
    try:
        for child in children:
            child.wait_ready()
        for _ in range(COMMIT_ROUNDS):
            for writers, notify in plan:
                runs[writers, notify].append(commits_run(ctx, children[:writers], notify, prefix))
    finally:
        for child in children:
            child.kill()
    rows = []
    for (writers, notify), figures in runs.items():
        plural = "s" if writers > 1 else ""
        rows.append({
            "name": f"{writers} writer{plural}, NOTIFY {'on' if notify else 'off'}",
            "writers": writers,
            "notify": notify,
            "commits": sum(f["commits"] for f in figures),
            "commit_rate": statistics.median(f["commit_rate"] for f in figures),
            "runs": [f["commit_rate"] for f in figures],
            "lock_wait": statistics.mean(f["lock_wait"] for f in figures),
        })  # fmt: skip
    ctx.results["commits"] = rows


def commits_run(ctx: Context, children: list[Child], notify: bool, prefix: str) -> Row:
    """The writers commit for ``--commit-seconds`` into a fresh table, while their sessions'
    wait events are sampled every 10 ms: the share of samples in which a writer waited for the
    lock NOTIFY takes at commit (a heavyweight lock on an ``object``, held to the commit's end)."""
    table = ctx.db.table()
    task = json.dumps({"table": table, "notify": notify, "seconds": ctx.args.commit_seconds})
    samples = [0, 0]  # writer sessions seen, of which waiting on NOTIFY's lock
    stop = threading.Event()

    def sample() -> None:
        with ctx.db.connect(autocommit=True) as conn:
            while not stop.wait(0.01):
                seen, waiting = conn.execute(
                    "SELECT count(*), count(*) FILTER (WHERE wait_event_type = 'Lock'"
                    " AND wait_event = 'object') FROM pg_stat_activity"
                    " WHERE application_name LIKE %s AND state = 'active'",
                    (prefix + "-%",),
                ).fetchone() or (0, 0)
                samples[0] += seen
                samples[1] += waiting

    sampler = threading.Thread(target=sample, daemon=True)
    with listening(ctx, table):
        sampler.start()
        results: list[dict[str, Any]] = []
        threads = [
            threading.Thread(target=lambda c=child: results.append(c.ask(task)))
            for child in children
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stop.set()
        sampler.join()
    ctx.db.drop(table)
    commits = sum(r["count"] for r in results)
    seconds = statistics.mean(r["seconds"] for r in results)
    return {
        "commits": commits,
        "commit_rate": commits / seconds,
        "lock_wait": samples[1] / samples[0] if samples[0] else 0.0,
    }


def section_sqlite(ctx: Context) -> None:
    with tempfile.TemporaryDirectory(prefix="ra-bench-outbox-") as directory:
        path = os.path.join(directory, "outbox.db")
        drain_from(ctx, "sqlite", "SQLite", ctx.args.sqlite_backlog, f"sqlite:///{path}",
                   lambda: sqlite3.connect(path))  # fmt: skip


def section_mariadb(ctx: Context) -> None:
    maria = ctx.mariadb()
    drain_from(ctx, "mariadb", "MariaDB", ctx.args.mariadb_backlog, maria.dsn, maria.connect)


def drain_from(  # noqa: PLR0917  (the database's every particular)
    ctx: Context, key: str, engine: str, count: int, dsn: str, connect: Callable[[], Any]
) -> None:
    """The drain's row on another database (``dsn``, its writer's connection from ``connect``):
    ``count`` rows written through Outbox.add_many into its ``amqp_outbox``, then drained as the
    drain section's row is, against publish_many of as many messages in this run."""
    outbox, conn = Outbox("amqp_outbox"), connect()
    try:
        outbox.install(conn)
        conn.commit()
        fill = write_backlog(conn, outbox, ctx.broker.exchange, count, ctx.args.size)
    finally:
        conn.close()
    fill["name"] = f"Outbox.add_many on {engine} (10,000 a transaction)"
    plain = ctx.publish_many(count)
    row = drain_row(ctx, f"OutboxRelay, {engine} backlog of {count:,}", count, db=dsn,
                    table="amqp_outbox")  # fmt: skip
    row["vs_publish_many"] = row["rate"] / plain["rate"]
    ctx.results[key] = [plain, row, fill]


# --- the writer on each application stack --------------------------------------------------


@dataclass
class Stack:
    """An application stack's writer, ready: ``add()`` and ``plain()`` each run one transaction
    of one row, through ``Outbox.add()`` or a plain INSERT of the same row, on the same
    connection and in the same transaction shape; coroutine functions run on ``loop`` when it
    is an asyncio stack."""

    name: str
    add: Callable[[], Any]
    plain: Callable[[], Any]
    loop: asyncio.AbstractEventLoop | None = None

    def timed(self, txn: Callable[[], Any], count: int) -> Row:
        """``count`` transactions of ``txn``: client CPU and wall time a row."""
        started, cpu = time.perf_counter(), time.process_time()
        if self.loop is None:
            for _ in range(count):
                txn()
        else:

            async def txns() -> None:
                for _ in range(count):
                    await txn()

            self.loop.run_until_complete(txns())
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        return {"cpu_us": cpu / count * 1e6, "txn_us": seconds / count * 1e6}


def section_stacks(ctx: Context) -> None:
    args = ctx.args
    per_round = max(1, args.writer_txns // ROUNDS)
    warm = min(50, per_round)
    rows = []
    for make in STACKS:
        with make(ctx, ctx.broker.exchange, body(0, args.size)) as stack:
            for txn in (stack.add, stack.plain):  # warm: connections, statement caches
                stack.timed(txn, warm)
            figures: dict[str, list[Row]] = {"add": [], "plain": []}
            for i in range(ROUNDS):  # interleaved, in turn first
                for variant in ("add", "plain")[:: 1 if i % 2 == 0 else -1]:
                    figures[variant].append(stack.timed(getattr(stack, variant), per_round))
        row: Row = {"name": stack.name, "txns": per_round * ROUNDS}
        for variant, measured_rows in figures.items():
            for key in ("cpu_us", "txn_us"):
                row[f"{variant}_{key}"] = statistics.median(r[key] for r in measured_rows)
        row["extra_cpu_us"] = row["add_cpu_us"] - row["plain_cpu_us"]
        row["extra_runs"] = [
            a["cpu_us"] - p["cpu_us"] for a, p in zip(figures["add"], figures["plain"], strict=True)
        ]
        rows.append(row)
    ctx.results["stacks"] = rows


StackMaker = Callable[[Context, str, bytes], contextlib.AbstractContextManager[Stack]]


@contextlib.contextmanager
def pg_table(ctx: Context) -> Iterator[str]:
    """A new outbox table in the run's PostgreSQL database, dropped after."""
    table = ctx.db.table()
    try:
        yield table
    finally:
        ctx.db.drop(table)


@contextlib.contextmanager
def stack_psycopg(ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    values = plain_values(exchange, payload)
    with pg_table(ctx) as table, ctx.db.connect() as conn:
        outbox, insert = Outbox(table), insert_sql(table, PERCENT_MARKS)

        def add() -> None:
            outbox.add(conn, exchange, ROUTING_KEY, payload)
            conn.commit()

        def plain() -> None:
            conn.execute(insert, values(), prepare=True)
            conn.commit()

        yield Stack("psycopg (PostgreSQL)", add, plain)


@contextlib.contextmanager
def stack_session(ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from reliable_amqp.outbox.sqlalchemy import outbox_table

    values = plain_values(exchange, payload)
    engine = sa.create_engine(ctx.db.dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    with pg_table(ctx) as table, Session(engine) as session:
        outbox, insert = Outbox(table), sa.insert(outbox_table(sa.MetaData(), table))

        def add() -> None:
            outbox.add(session, exchange, ROUTING_KEY, payload)
            session.commit()

        def plain() -> None:
            session.execute(insert, dict(zip(WRITE_COLUMNS, values(), strict=True)))
            session.commit()

        yield Stack("SQLAlchemy Session (psycopg)", add, plain)
    engine.dispose()


@contextlib.contextmanager
def event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


@contextlib.contextmanager
def stack_async_session(ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from reliable_amqp.outbox.sqlalchemy import outbox_table

    values = plain_values(exchange, payload)
    with pg_table(ctx) as table, event_loop() as loop:
        dsn = ctx.db.dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
        engine = create_async_engine(dsn)
        session = AsyncSession(engine)
        outbox, insert = AsyncOutbox(table), sa.insert(outbox_table(sa.MetaData(), table))

        async def add() -> None:
            await outbox.add(session, exchange, ROUTING_KEY, payload)
            await session.commit()

        async def plain() -> None:
            await session.execute(insert, dict(zip(WRITE_COLUMNS, values(), strict=True)))
            await session.commit()

        try:
            yield Stack("SQLAlchemy AsyncSession (asyncpg)", add, plain, loop)
        finally:
            loop.run_until_complete(session.close())
            loop.run_until_complete(engine.dispose())


@contextlib.contextmanager
def stack_asyncpg(ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    import asyncpg

    values = plain_values(exchange, payload)
    with pg_table(ctx) as table, event_loop() as loop:
        conn = loop.run_until_complete(asyncpg.connect(ctx.db.dsn))
        marks = [f"${i}" for i in range(1, len(WRITE_COLUMNS) + 1)]
        outbox, insert = AsyncOutbox(table), insert_sql(table, marks)

        async def add() -> None:
            async with conn.transaction():
                await outbox.add(conn, exchange, ROUTING_KEY, payload)

        async def plain() -> None:
            async with conn.transaction():
                await conn.execute(insert, *values())

        try:
            yield Stack("asyncpg", add, plain, loop)
        finally:
            loop.run_until_complete(conn.close())


@contextlib.contextmanager
def stack_django(ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    import django
    from django.conf import settings

    if not settings.configured:  # once a process: the run's database
        url = urlsplit(ctx.db.dsn)
        settings.configure(USE_TZ=True, DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": ctx.db.name,
            "USER": url.username or "", "PASSWORD": url.password or "",
            "HOST": url.hostname or "", "PORT": str(url.port or ""),
        }})  # fmt: skip
        django.setup()
    from django.db import connection, transaction

    values = plain_values(exchange, payload)
    with pg_table(ctx) as table:
        outbox, insert = Outbox(table), insert_sql(table, PERCENT_MARKS)

        def add() -> None:
            with transaction.atomic():
                outbox.add(connection, exchange, ROUTING_KEY, payload)

        def plain() -> None:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(insert, values())

        try:
            yield Stack("Django atomic() (PostgreSQL)", add, plain)
        finally:
            connection.close()


@contextlib.contextmanager
def stack_pymysql(ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    values = plain_values(exchange, payload)
    outbox, conn = Outbox("stack_pymysql"), ctx.mariadb().connect()
    insert = insert_sql(mysql_quote(outbox.table), PERCENT_MARKS, mysql_columns(WRITE_COLUMNS))
    with conn:
        outbox.install(conn)

        def add() -> None:
            outbox.add(conn, exchange, ROUTING_KEY, payload)
            conn.commit()

        def plain() -> None:
            with conn.cursor() as cursor:
                cursor.execute(insert, values())
            conn.commit()

        yield Stack("PyMySQL (MariaDB)", add, plain)


@contextlib.contextmanager
def stack_sqlite(_ctx: Context, exchange: str, payload: bytes) -> Iterator[Stack]:
    values = plain_values(exchange, payload)
    outbox = Outbox("amqp_outbox")
    insert = insert_sql(outbox.table, ["?"] * len(WRITE_COLUMNS))
    with tempfile.TemporaryDirectory(prefix="ra-bench-outbox-") as directory:
        conn = sqlite3.connect(os.path.join(directory, "outbox.db"))
        conn.execute("PRAGMA journal_mode=WAL")  # as beside a relay, which reads as it writes
        outbox.install(conn)
        conn.commit()

        def add() -> None:
            outbox.add(conn, exchange, ROUTING_KEY, payload)
            conn.commit()

        def plain() -> None:
            conn.execute(insert, values())
            conn.commit()

        try:
            yield Stack("sqlite3", add, plain)
        finally:
            conn.close()


#: the stacks section's rows, in order
STACKS: tuple[StackMaker, ...] = (
    stack_psycopg, stack_session, stack_async_session, stack_asyncpg, stack_django,
    stack_pymysql, stack_sqlite,
)  # fmt: skip


# --- printing ---------------------------------------------------------------------------------


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def print_results(ctx: Context) -> None:
    results, args = ctx.results, ctx.args
    maria = f", MariaDB {ctx.maria.version()}" if ctx.maria else ""
    print(
        f"\n== outbox: {args.size} B bodies, persistent, mandatory, one durable lazy queue "
        f"(PostgreSQL {server_version(ctx.db)}{maria}, {os.cpu_count()} cores) =="
    )
    print(f"library: {library_source()}")
    print(f"load average at the start: {ctx.load}; sections took {ctx.took} (seconds)")
    for key, title in (("drain", f"drain: a {args.backlog:,}-row backlog, one relay"),
                       ("relays", "two relays against one"),
                       ("sqlite", f"SQLite: a {args.sqlite_backlog:,}-row backlog, one relay"),
                       ("mariadb", f"MariaDB (PyMySQL): a {args.mariadb_backlog:,}-row backlog, "
                        "one relay")):  # fmt: skip
        if key not in results:
            continue
        print(f"\n-- {title} --")
        print(
            f"{'row':<62} {'msgs':>9} {'msgs/s':>8} {'halves':>13} {'ratio':>6} "
            f"{'client CPU':>10} {'DB CPU':>9} {'broker CPU':>10} {'all CPU':>9} {'broker':>6} "
            f"{'machine':>7}"
        )
        for r in results[key]:
            ratio = r.get("vs_publish_many", r.get("vs_one"))
            first, second = r.get("halves") or (None, None)
            halves = f"{fmt(first, ',.0f')}/{fmt(second, ',.0f')}" if first else "-"
            print(
                f"{r['name']:<62} {r['msgs']:>9,} {r['rate']:>8,.0f} {halves:>13} "
                f"{fmt(ratio, '.2f', 'x'):>6} "
                f"{fmt(r.get('cpu_us'), '.1f', ' us'):>10} "
                f"{fmt(r.get('backend_cpu_us'), '.1f', ' us'):>9} "
                f"{fmt(r.get('broker_cpu_us'), '.1f', ' us'):>10} "
                f"{fmt(all_cpu(r), '.1f', ' us'):>9} "
                f"{fmt(r.get('broker_cores'), '.2f'):>6} "
                f"{fmt(r.get('machine_busy', None) and r['machine_busy'] * 100, '.0f', '%'):>7}"
            )
        print(
            "  halves: msgs/s while the queue took its first and its second half; CPU columns: "
            "per message (client: the\n  process's own; DB: PostgreSQL's backends of the "
            "relays, MariaDB's whole mariadbd, SQLite's in the client; broker:\n  beam.smp; "
            "all: the three); broker: cores it used; machine: busy share of all cores"
        )
        relay = next((r for r in results[key] if r["name"].startswith("OutboxRelay")), None)
        plain = next((r for r in results[key] if r["name"].startswith("Publisher")), None)
        relay_cpu = all_cpu(relay) if relay else None
        plain_cpu = all_cpu(plain) if plain else None
        if relay_cpu and plain_cpu:
            print(
                f"  CPU a message, all of it: publish_many {plain_cpu:.1f} us, the relay "
                f"{relay_cpu:.1f} us; on a machine whose cores are all busy the rates "
                f"follow: {plain_cpu / relay_cpu:.2f}x"
            )
        if key == "relays" and len(results[key]) == 2:
            print(f"  2 relays published {results[key][1]['published']} rows each")
    if "rss" in results:
        rows = results["rss"]
        print("\n-- relay memory (its process) --")
        print(f"{'row':<62} {'RSS ready':>10} {'peak VmRSS':>11} {'VmHWM':>9} {'growth':>9}")
        for r in rows:
            print(
                f"{r['name']:<62} {r['rss_ready_mb']:>7.1f} MB {r['rss_peak_mb']:>8.1f} MB "
                f"{r['rss_hwm_mb']:>6.1f} MB {r['rss_peak_mb'] - r['rss_ready_mb']:>+6.1f} MB"
            )
        print("  ready: once imported and built, before run(); growth: peak VmRSS - ready")
        if len(rows) == 2:
            print(f"  peak difference: {rows[1]['rss_peak_mb'] - rows[0]['rss_peak_mb']:+.1f} MB")
    if "latency" in results:
        print(
            f"\n-- commit to confirm: an idle relay, {args.latency_writers} writer threads, "
            f"{args.rate:,} transactions/s of one add() --"
        )
        print(
            f"{'row':<38} {'commits':>8} {'/s':>6} {'confirm p50':>11} {'p99':>9} "
            f"{'delivery p50':>12} {'p99':>9} {'commit p50':>10} {'p99':>8} {'relay CPU':>9} "
            f"{'a message':>9}"
        )
        for r in results["latency"]:
            print(
                f"{r['name']:<38} {r['commits']:>8,} {r['commit_rate']:>6,.0f} "
                f"{fmt(r['confirm_p50_ms'], '.1f', ' ms'):>11} "
                f"{fmt(r['confirm_p99_ms'], '.1f', ' ms'):>9} "
                f"{fmt(r['delivery_p50_ms'], '.1f', ' ms'):>12} "
                f"{fmt(r['delivery_p99_ms'], '.1f', ' ms'):>9} "
                f"{fmt(r['commit_p50_ms'], '.1f', ' ms'):>10} "
                f"{fmt(r['commit_p99_ms'], '.1f', ' ms'):>8} "
                f"{r['relay_cpu_pct']:>8.0f}% "
                f"{r['relay_cpu_us']:>6.0f} us"
            )
        print(
            "  confirm: relay.stats(), from add() (the row's created_at) to the relay taking the "
            "broker's confirm;\n  delivery: a consumer of the queue, from commit() returning in "
            "the writer to the delivery;\n  commit: in the writer, from add() to commit() "
            "returning (part of confirm's figure, not of delivery's);\n  relay CPU: its "
            "process's, in % of one core over its run, and per message (idle time included)"
        )
    if "writer" in results:
        print("\n-- the writer's cost: one connection, rows per transaction as shown --")
        print(
            f"{'row':<28} {'rows/txn':>8} {'txns':>6} {'in statement':>12} {'vs INSERT':>9} "
            f"{'with commit':>11} {'client CPU':>10} {'txns/s':>8}"
        )
        for r in results["writer"]:
            print(
                f"{r['name']:<28} {r['rows_per_txn']:>8} {r['txns']:>6,} "
                f"{r['statement_us']:>9.1f} us {r['extra_us_per_row']:>+6.1f} us "
                f"{r['total_us']:>8.1f} us {r['cpu_us']:>7.1f} us {r['txn_rate']:>8,.0f}"
            )
        print("  per row; in statement: the add() or INSERT calls, the commit excluded")
    if "commits" in results:
        print(
            f"\n-- NOTIFY and concurrent commits: writer processes, one add() a transaction, "
            f"{args.commit_seconds:g} s a round --"
        )
        print(f"{'row':<28} {'commits':>9} {'commits/s':>10} {'(rounds)':>16} {'NOTIFY lock':>11}")
        for r in results["commits"]:
            rounds = "/".join(f"{rate:,.0f}" for rate in r["runs"])
            print(
                f"{r['name']:<28} {r['commits']:>9,} {r['commit_rate']:>10,.0f} {rounds:>16} "
                f"{r['lock_wait']:>10.0%}"
            )
        print(
            f"  {COMMIT_ROUNDS} rounds interleaved, the median; NOTIFY lock: share of the "
            "writers' sampled states (every 10 ms)\n  spent waiting for the lock NOTIFY "
            "takes at commit (pg_stat_activity: Lock, object)"
        )
    if "stacks" in results:
        print(
            "\n-- the writer on each stack: one row a transaction, add() against a plain INSERT "
            "of the same row --"
        )
        print(
            f"{'stack':<34} {'txns':>6} {'add() CPU':>10} {'INSERT CPU':>10} {'extra CPU':>10} "
            f"{'add() txn':>10} {'INSERT txn':>10} {'extra CPU, rounds':>18}"
        )
        for r in results["stacks"]:
            print(
                f"{r['name']:<34} {r['txns']:>6,} {r['add_cpu_us']:>7.1f} us "
                f"{r['plain_cpu_us']:>7.1f} us {r['extra_cpu_us']:>+7.1f} us "
                f"{r['add_txn_us']:>7.0f} us {r['plain_txn_us']:>7.0f} us "
                f"{min(r['extra_runs']):>+6.0f} to {max(r['extra_runs']):>+4.0f} us"
            )
        print(
            f"  per row; CPU: this process's (time.process_time), {ROUNDS} rounds interleaved, "
            "the median; extra: add() CPU - INSERT CPU (of the medians;\n  rounds: the "
            "lowest and highest of the rounds' own); txn: wall time of the whole transaction "
            "(the database's work and\n  the commit's wait included)"
        )


def all_cpu(row: Row) -> float | None:
    """Client, PostgreSQL and broker CPU a message (None when the client's or the broker's is
    not known; PostgreSQL's counts 0 for a row that does not use it)."""
    if row.get("cpu_us") is None or row.get("broker_cpu_us") is None:
        return None
    return float(row["cpu_us"] + (row.get("backend_cpu_us") or 0.0) + row["broker_cpu_us"])


def library_source() -> str:
    """Where reliable_amqp was imported from, and its git commit (with "+changes" when its
    outbox package differs from that commit) when it is a checkout."""
    import reliable_amqp

    src = Path(reliable_amqp.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "outbox"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return str(src)
    return f"{src} at {rev}{' +changes in outbox/' if dirty else ''}"


def server_version(db: Database) -> str:
    with db.connect() as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]).split()[0] if row else "?"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--backlog", type=int, default=1_000_000, help="rows (1,000,000)")
    parser.add_argument(
        "--small-backlog", type=int, default=0, help="the rss section's smaller backlog "
        "(default: a tenth of --backlog)"
    )  # fmt: skip
    parser.add_argument("--size", type=int, default=200, help="body bytes (200)")
    parser.add_argument(
        "--ceiling-count", type=int, default=200_000, help="messages of the broker-ceiling row"
    )
    parser.add_argument("--rate", type=int, default=500, help="latency: transactions/s (500)")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--latency-writers", type=int, default=4, help="writer threads (4)")
    parser.add_argument(
        "--writer-txns", type=int, default=2000, help="writer, stacks: one-row transactions "
        "(2,000; the writer: a tenth as many of 100 rows)"
    )  # fmt: skip
    parser.add_argument("--writers", type=int, default=8, help="commits: writer processes (8)")
    parser.add_argument("--commit-seconds", type=float, default=5.0)
    parser.add_argument("--sqlite-backlog", type=int, default=200_000)
    parser.add_argument("--mariadb-backlog", type=int, default=200_000)
    parser.add_argument("--only", default=",".join(SECTIONS), help=",".join(SECTIONS))
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, for a smoke test (seconds)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--save", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--url", default=URL)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(json.loads(args.child))
    BROKER["url"] = args.url
    if args.quick:
        args.backlog, args.small_backlog, args.ceiling_count = 3000, 1000, 2000
        args.rate, args.latency_seconds, args.writer_txns = 100, 0.5, 40
        args.writers, args.commit_seconds = 2, 0.2
        args.sqlite_backlog = args.mariadb_backlog = 3000
    sections = args.only.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}")
    db, broker = Database(PG, checkpoint=not args.quick), Broker(args.url)
    with open("/proc/loadavg") as loadavg:
        ctx = Context(args, db, broker, load=" ".join(loadavg.read().split()[:3]))
    try:
        for section in SECTIONS:
            if section in sections:
                print(f" {section} ...", file=sys.stderr)
                started = time.perf_counter()
                globals()[f"section_{section}"](ctx)
                ctx.took[section] = round(time.perf_counter() - started)
                print(f"   {ctx.took[section]} s", file=sys.stderr)
        figures = {**ctx.results, "load": ctx.load, "took": ctx.took}
        if args.save:
            Path(args.save).write_text(json.dumps(figures, indent=2))
        if args.json:
            print(json.dumps(figures, indent=2))
        else:
            print_results(ctx)
    finally:
        if ctx.listener is not None:
            ctx.listener.result()  # its stdin closed: it ends
        if ctx.maria is not None:
            ctx.maria.close()
        db.close()
        broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
