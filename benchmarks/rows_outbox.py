"""The rows of ``benchmarks/outbox.py`` that drain a backlog: the relay against
``Publisher.publish_many`` and the broker's ceiling (drain), its memory at two backlogs (rss),
two relays (relays), an idle relay's latency (latency), and the SQLite and MariaDB drains.
:class:`Context` is the run's state every section takes.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika

sys.path.insert(0, str(Path(__file__).resolve().parent))

from broker_idle import wait_idle
from outbox_children import Child
from outbox_harness import (
    MYSQL,
    ROUTING_KEY,
    Broker,
    Database,
    MariaDB,
    Row,
    body,
    broker_cpu,
    copy_backlog,
    fill_template,
    machine_cpu,
    measured,
    port_owner,
    relay_spec,
    write_backlog,
)
from raw_ceiling import raw_confirmed_seconds

from reliable_amqp.outbox import Outbox, status

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
    #: the load averages when the run started (other work on a shared machine shows here)
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
        broker, machine = broker_cpu(), machine_cpu()
        seconds = raw_confirmed_seconds(
            ctx.args.url, queue, count, body(0, ctx.args.size), window=10_000
        )
        after, (busy, total) = broker_cpu(), machine_cpu()
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
        "machine_busy": (busy - machine[0]) / max(1e-9, total - machine[1]),
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
