"""The rows of ``benchmarks/outbox.py`` on the writer's side: ``add()`` against a plain INSERT
(writer), NOTIFY and the writers' commits (commits), and the writer on each application stack
(stacks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))


from outbox_children import Child
from outbox_harness import (
    PERCENT_MARKS,
    ROUTING_KEY,
    Row,
    body,
    insert_sql,
    plain_values,
    unique_name,
)
from rows_outbox import Context

from reliable_amqp.outbox import AsyncOutbox, Outbox
from reliable_amqp.outbox._schema import WRITE_COLUMNS, mysql_columns, mysql_quote

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
