"""The harness of ``benchmarks/outbox.py`` (issue 29): the run's exchange and queues on the
broker, its PostgreSQL and MariaDB databases and backlog tables, the processes measured (psutil:
CPU, memory, the broker's and a database server's pid by the port it listens on), and the watch
over a measured run (the queue's depth, the relays' PostgreSQL backends). The rows are in
``rows_outbox.py`` and ``rows_outbox_writers.py``, the processes of their own in
``outbox_children.py``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import pika
import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from broker_idle import broker_pids

from reliable_amqp.outbox import Outbox
from reliable_amqp.outbox._rows import row_values
from reliable_amqp.outbox._schema import WRITE_COLUMNS

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
PG = os.environ.get("OUTBOX_PG", "postgresql://postgres@127.0.0.1:5432")
MYSQL = os.environ.get("OUTBOX_MYSQL", "mysql://root@127.0.0.1:3306")
SECTIONS = ("drain", "rss", "relays", "latency", "writer", "commits", "sqlite", "mariadb", "stacks")
ROUTING_KEY = "bench"

Row = dict[str, Any]


def body(i: int, size: int) -> bytes:
    """The ``i``-th message's body: its number, then padding."""
    head = b"%012d" % i
    return head + b"x" * (size - len(head))


# --- processes (psutil) -----------------------------------------------------------------------


def proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, None once it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


def proc_kb(pid: int) -> int | None:
    """The resident memory of process ``pid`` in kB, None once it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss) // 1024
    except psutil.Error:
        return None


def peak_kb() -> int:
    """This process's peak resident memory so far, in kB (macOS counts ru_maxrss in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak // 1024 if sys.platform == "darwin" else peak)


#: the broker whose CPU is measured (main() sets it to --url) and its pid, once found
BROKER = {"url": URL}
_BROKER_PID: list[int | None] = []


def port_owner(port: int, pids: Sequence[int] | None = None) -> int | None:
    """The process of ``pids`` (default: every process) listening on TCP ``port``, None when
    none is (the server is not on this machine, or not visible from here)."""
    for pid in psutil.pids() if pids is None else pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:  # gone, or not ours to look at
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
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


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core so far (idle and iowait are not busy)."""
    times = psutil.cpu_times()
    total = sum(times)
    return total - times.idle - getattr(times, "iowait", 0.0), total


def load_average() -> str:
    """The machine's load averages (1, 5, 15 minutes): other work on a shared machine shows."""
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


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
        self._machine = machine_cpu()
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
        busy, total = machine_cpu()
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


class Measured(Protocol):
    """A process of its own that :func:`measured` starts and watches (``outbox_children.Child``,
    which imports this module: the harness names only what it calls, so no import circle)."""

    @property
    def pid(self) -> int: ...
    def wait_ready(self) -> None: ...
    def go(self) -> None: ...
    def stop(self) -> None: ...
    def result(self, timeout: float = ...) -> dict[str, Any]: ...
    def kill(self) -> None: ...


def measured(
    url: str,
    queue: str,
    count: int,
    children: Sequence[Measured],
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
