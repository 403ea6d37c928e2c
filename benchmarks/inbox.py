"""The inbox's price (issue 40): a handler that inserts one row per message in a transaction of
its own, without the inbox and with it, in the same run, on PostgreSQL, SQLite and MariaDB.

    bash scripts/dev.sh run python benchmarks/inbox.py                      # 2,000 a round
    bash scripts/dev.sh run python benchmarks/inbox.py --messages 5000 --rounds 5
    bash scripts/dev.sh run python benchmarks/inbox.py --preload 1000000 --only postgresql
    bash scripts/dev.sh run python benchmarks/inbox.py --json

Ways of handling each message, in rounds interleaved (plain, claim, handler, pool, connect,
plain, ...) so that the machine's load falls on all of them alike:

- **plain**: ``BEGIN; INSERT INTO effects ...; COMMIT`` on one connection (the bare
  transaction, what each ratio compares with);
- **claim**: the same transaction with ``Inbox.claim()`` first;
- **handler**: ``Inbox.handler(connect, handle)`` doing the same on one long-lived connection
  (the helper's own overhead: its connection checks, the transaction block);
- **pool** (PostgreSQL and MariaDB): ``Inbox.handler(engine.connect, handle)``, a connection
  borrowed from SQLAlchemy's pool (its defaults) for each message, docs/inbox.md's
  recommended pattern;
- **connect** (PostgreSQL and MariaDB): ``Inbox.handler(lambda: psycopg.connect(dsn), ...)``
  (PyMySQL's ``connect`` on MariaDB), a new connection for each message, what the docs'
  example did before (issue 48); a tenth of the messages a round (at least 20), it is slow.

Each message has a fresh id, so every claim is new (a duplicate is cheaper: it writes nothing):
as this library's publishers make them by default, uuid4 with ``--random-ids``. On PostgreSQL
the difference shows: a random key touches a new page of the primary key with nearly every
claim, and the first change of a page after a checkpoint writes the whole page to the WAL
that the commit then syncs.
``--preload N`` fills the inbox with N older claims first (the claim's cost with a big table).
Reported: messages a second (median of the rounds), the ratio to plain (target >= 0.75) and
the client's CPU time a message (median of the rounds: steadier than rates on a shared machine).
PostgreSQL: $INBOX_PG (default postgresql://postgres@127.0.0.1:5432), a database of its own,
dropped after; synchronous_commit as the server has it. SQLite: a file in a temporary
directory, WAL, with ``synchronous=FULL`` and ``NORMAL`` (``--sqlite-synchronous``). FULL is the
setting the inbox's promise needs there: in WAL mode NORMAL does not sync at commit, so a power
loss can undo commits whose messages were acked already. Without that sync, a commit costs
little more than the pages it writes, and the claim's two b-trees show (see docs/inbox.md).
MariaDB: $INBOX_MYSQL (default mysql://root@127.0.0.1:3306), a database of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from reliable_amqp._core.message import new_message_id
from reliable_amqp.inbox import Inbox
from reliable_amqp.outbox._adapters import sync_writer

PG = os.environ.get("INBOX_PG", "postgresql://postgres@127.0.0.1:5432")
MYSQL = os.environ.get("INBOX_MYSQL", "mysql://root@127.0.0.1:3306")
BODY = "x" * 200


#: how each message's id is made: as this library's publishers make them (a per-process random
#: prefix and a counter: new ids land near each other in the primary key), or --random-ids
#: (uuid4: every claim lands on a random page of the key, the worst case for the index)
_new_id: Callable[[], str] = new_message_id


def _delivery() -> Any:
    return SimpleNamespace(message_id=_new_id(), redelivered=False, headers={})


@dataclass(frozen=True)
class Target:
    """A benchmark's database: ``connect()`` opens a new connection; ``url`` is SQLAlchemy's
    URL of it (None: no pool row for this database)."""

    connect: Callable[[], Any]
    url: str | None = None


@contextlib.contextmanager
def _pg() -> Iterator[Target]:
    import psycopg

    name = "ra_bench_" + uuid.uuid4().hex[:10]
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        url = f"{PG}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
        yield Target(lambda: psycopg.connect(f"{PG}/{name}"), url)
    finally:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def _sqlite(synchronous: str) -> Iterator[Target]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")

        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(path, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={synchronous}")
            return conn

        yield Target(connect)


@contextlib.contextmanager
def _mysql() -> Iterator[Target]:
    import pymysql

    from reliable_amqp.outbox._mysql import connect_args

    name = "ra_bench_" + uuid.uuid4().hex[:10]
    args = connect_args(f"{MYSQL}/{name}")
    server = {k: v for k, v in args.items() if k != "database"}
    with pymysql.connect(**server, autocommit=True) as admin, admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
    try:
        yield Target(
            lambda: pymysql.connect(**args),
            f"{MYSQL}/{name}".replace("mysql://", "mysql+pymysql://", 1) + "?charset=utf8mb4",
        )
    finally:
        with pymysql.connect(**server, autocommit=True) as admin, admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS {name}")


def _setup(connect: Callable[[], Any], inbox: Inbox, preload: int) -> None:
    conn = connect()
    writer = sync_writer(conn)
    dialect = writer.dialect(conn)
    with writer.transaction(conn):
        inbox.install(conn)
    with writer.transaction(conn):
        writer.run(
            conn,
            "CREATE TABLE effects (message_id varchar(64) NOT NULL, body text NOT NULL,"
            " created_at double precision NOT NULL)",
        )
    if preload:
        old = time.time() - 86400
        mark = "?" if dialect == "sqlite" else "%s"
        sql = (
            f"INSERT INTO {inbox.table} (scope, message_id, claimed_at)"
            f" VALUES ({mark}, {mark}, {mark})"
        )
        for start in range(0, preload, 50_000):
            rows = [
                ("bench", f"pre-{i:09d}", old) for i in range(start, min(preload, start + 50_000))
            ]
            with writer.transaction(conn):
                conn.cursor().executemany(sql, rows)
        print(f"  preloaded {preload:,} claims", file=sys.stderr)
    conn.close()


def _effect(conn: Any, delivery: Any) -> None:
    sync_writer(conn).run(
        conn,
        "INSERT INTO effects (message_id, body, created_at) VALUES (%s, %s, %s)",
        (delivery.message_id, BODY, time.time()),
    )


def _round(
    way: str, conn: Any, inbox: Inbox, messages: int, connect: Any = None
) -> tuple[float, float]:
    """(messages a second, client CPU microseconds a message) of one round handled ``way``
    (``connect``: the handler's, for the pool and connect ways)."""
    writer = sync_writer(conn)
    handle: Callable[[Any, Any], None] = lambda d, c: _effect(c, d)  # noqa: E731
    handler = inbox.handler(connect or (lambda: contextlib.nullcontext(conn)), handle)
    if way == "connect":
        messages = max(20, messages // 10)
    deliveries = [_delivery() for _ in range(messages)]
    start, cpu = time.perf_counter(), time.process_time()
    if way == "plain":
        for delivery in deliveries:
            with writer.transaction(conn):
                _effect(conn, delivery)
    elif way == "claim":
        for delivery in deliveries:
            with writer.transaction(conn):
                if inbox.claim(conn, delivery):
                    _effect(conn, delivery)
    else:
        for delivery in deliveries:
            handler(delivery)
    cpu_us = (time.process_time() - cpu) / messages * 1e6
    return messages / (time.perf_counter() - start), cpu_us


WAYS = ("plain", "claim", "handler", "pool", "connect")


def measure(name: str, opened: Any, messages: int, rounds: int, preload: int) -> dict[str, Any]:
    with opened as target:
        inbox = Inbox("bench")
        _setup(target.connect, inbox, preload)
        ways = WAYS if target.url else WAYS[:3]
        engine = None
        connects: dict[str, Any] = {}
        if target.url:
            import sqlalchemy as sa

            engine = sa.create_engine(target.url)
            connects = {"pool": engine.connect, "connect": target.connect}
        conn = target.connect()
        for way in ways:  # warm up: caches, prepared statements, the pool's first connection
            _round(way, conn, inbox, min(200, messages), connects.get(way))
        rates: dict[str, list[float]] = {way: [] for way in ways}
        cpus: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(rounds):
            for way in ways:
                rate, cpu_us = _round(way, conn, inbox, messages, connects.get(way))
                rates[way].append(rate)
                cpus[way].append(cpu_us)
        conn.close()
        if engine is not None:
            engine.dispose()
    median = {way: statistics.median(values) for way, values in rates.items()}
    cpu = {way: statistics.median(values) for way, values in cpus.items()}
    result = {
        "database": name,
        "messages_per_round": messages,
        "rounds": rounds,
        "preload": preload,
        "ids": "uuid4" if _new_id is not new_message_id else "library",
        "per_s": {way: round(value, 1) for way, value in median.items()},
        "ratio": {way: round(median[way] / median["plain"], 3) for way in ways[1:]},
        "rounds_per_s": {way: [round(v, 1) for v in values] for way, values in rates.items()},
        "cpu_us": {way: round(value, 1) for way, value in cpu.items()},
    }
    line = f"{name:<22} plain {median['plain']:>8,.0f}/s"
    for way in ways[1:]:
        line += f"   {way} {median[way]:>7,.0f}/s ({median[way] / median['plain']:.2f}x)"
    print(line, flush=True)
    cpus_line = "   ".join(f"{way} {cpu[way]:,.0f}" for way in ways)
    print(f"{'':<22} client CPU a message (us): {cpus_line}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages a round (2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way (3)")
    parser.add_argument("--preload", type=int, default=0, help="older claims in the inbox (0)")
    parser.add_argument("--only", default="postgresql,sqlite,mariadb", help="which databases")
    parser.add_argument(
        "--sqlite-synchronous", default="FULL,NORMAL", help="FULL, NORMAL or both (FULL,NORMAL)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object a database")
    parser.add_argument(
        "--random-ids", action="store_true", help="uuid4 message ids instead of the library's"
    )
    args = parser.parse_args(argv)
    global _new_id  # noqa: PLW0603  (a benchmark's switch, set once before it runs)
    if args.random_ids:
        _new_id = lambda: uuid.uuid4().hex  # noqa: E731
    only = set(args.only.split(","))
    results = []
    if "postgresql" in only:
        results.append(measure("postgresql", _pg(), args.messages, args.rounds, args.preload))
    for sync in args.sqlite_synchronous.upper().split(",") if "sqlite" in only else ():
        name = f"sqlite (WAL, {sync})"
        results.append(measure(name, _sqlite(sync), args.messages, args.rounds, args.preload))
    if "mariadb" in only:
        results.append(measure("mariadb", _mysql(), args.messages, args.rounds, args.preload))
    if args.json:
        for result in results:
            print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
