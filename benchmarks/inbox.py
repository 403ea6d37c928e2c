"""The inbox's price (issue 40): a handler that inserts one row per message in a transaction of
its own, without the inbox and with it, in the same run, on PostgreSQL, SQLite and MariaDB.

    bash scripts/dev.sh run python benchmarks/inbox.py                      # 2,000 a round
    bash scripts/dev.sh run python benchmarks/inbox.py --messages 5000 --rounds 5
    bash scripts/dev.sh run python benchmarks/inbox.py --preload 1000000 --only postgresql
    bash scripts/dev.sh run python benchmarks/inbox.py --json

Three ways of handling each message, in rounds interleaved (plain, claim, handler, plain, ...)
so that the machine's load falls on all of them alike:

- **plain**: ``BEGIN; INSERT INTO effects ...; COMMIT`` on one connection;
- **claim**: the same transaction with ``Inbox.claim()`` first;
- **handler**: ``Inbox.handler(connect, handle)`` doing the same (the helper's own overhead:
  its connection checks, the transaction block).

Each message has a fresh id, so every claim is new (a duplicate is cheaper: it writes nothing):
as this library's publishers make them by default, uuid4 with ``--random-ids``. On PostgreSQL
the difference shows: a random key touches a new page of the primary key with nearly every
claim, and the first change of a page after a checkpoint writes the whole page to the WAL
that the commit then syncs.
``--preload N`` fills the inbox with N older claims first (the claim's cost with a big table).
Reported: messages a second (median of the rounds) and the ratio to plain (target >= 0.75).
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


@contextlib.contextmanager
def _pg() -> Iterator[Callable[[], Any]]:
    import psycopg

    name = "ra_bench_" + uuid.uuid4().hex[:10]
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield lambda: psycopg.connect(f"{PG}/{name}")
    finally:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def _sqlite(synchronous: str) -> Iterator[Callable[[], Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")

        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(path, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={synchronous}")
            return conn

        yield connect


@contextlib.contextmanager
def _mysql() -> Iterator[Callable[[], Any]]:
    import pymysql

    from reliable_amqp.outbox._mysql import connect_args

    name = "ra_bench_" + uuid.uuid4().hex[:10]
    args = connect_args(f"{MYSQL}/{name}")
    server = {k: v for k, v in args.items() if k != "database"}
    with pymysql.connect(**server, autocommit=True) as admin, admin.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
    try:
        yield lambda: pymysql.connect(**args)
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


def _round(way: str, conn: Any, inbox: Inbox, messages: int) -> float:
    """Messages a second of one round handled ``way``."""
    writer = sync_writer(conn)
    handler = inbox.handler(lambda: contextlib.nullcontext(conn), lambda d, c: _effect(c, d))
    deliveries = [_delivery() for _ in range(messages)]
    start = time.perf_counter()
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
    return messages / (time.perf_counter() - start)


WAYS = ("plain", "claim", "handler")


def measure(name: str, opened: Any, messages: int, rounds: int, preload: int) -> dict[str, Any]:
    with opened as connect:
        inbox = Inbox("bench")
        _setup(connect, inbox, preload)
        conn = connect()
        _round("plain", conn, inbox, min(200, messages))  # warm up: caches, prepared statements
        _round("claim", conn, inbox, min(200, messages))
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                rates[way].append(_round(way, conn, inbox, messages))
        conn.close()
    median = {way: statistics.median(values) for way, values in rates.items()}
    result = {
        "database": name,
        "messages_per_round": messages,
        "rounds": rounds,
        "preload": preload,
        "ids": "uuid4" if _new_id is not new_message_id else "library",
        "per_s": {way: round(value, 1) for way, value in median.items()},
        "ratio": {way: round(median[way] / median["plain"], 3) for way in WAYS[1:]},
        "rounds_per_s": {way: [round(v, 1) for v in values] for way, values in rates.items()},
    }
    print(
        f"{name:<22} plain {median['plain']:>8,.0f}/s   claim {median['claim']:>8,.0f}/s "
        f"({median['claim'] / median['plain']:.2f}x)   handler {median['handler']:>8,.0f}/s "
        f"({median['handler'] / median['plain']:.2f}x)",
        flush=True,
    )
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
