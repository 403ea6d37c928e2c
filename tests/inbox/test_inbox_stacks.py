"""The inbox on each kind of connection the outbox takes, against the real databases: SQLAlchemy
``Session`` and ``Connection`` (sync), ``AsyncSession`` (asyncpg) and ``AsyncConnection``
(psycopg), a bare psycopg ``AsyncConnection``, a bare asyncpg connection, and Django's
connection in ``transaction.atomic()`` (psycopg, PyMySQL and sqlite3 themselves:
test_claim.py). For each: install twice, duplicates and a handler failing after its claim give
one effect per id, a claim that would commit on its own is refused, the attempts ledger counts
through a factory, and prune runs its own transactions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from reliable_amqp import ConfigurationError
from reliable_amqp.inbox import AsyncInbox, Inbox
from reliable_amqp.outbox._adapters import async_writer, sync_writer
from support.inbox import FakeDelivery

SRC = Path(__file__).resolve().parents[2] / "src"
HERE = Path(__file__).resolve().parent

IDS = [f"m{i}" for i in range(10)]
#: each id twice (the second a redelivery), and m3 failing once after its claim
DELIVERIES = [FakeDelivery(i) for i in IDS] + [FakeDelivery(i, redelivered=True) for i in IDS]
EFFECTS = "CREATE TABLE effects (message_id varchar(255) NOT NULL)"


def _url(dsn: str, driver: str) -> str:
    scheme, rest = dsn.split("://", 1)
    return f"{scheme}+{driver}://{rest}"


# --- sync -------------------------------------------------------------------------------------


def _sync_scenario(connect: Callable[[], Any], factory: Callable[[], Any]) -> None:
    inbox = Inbox("svc")
    for _ in range(2):
        with connect() as conn:
            writer = sync_writer(conn)
            with writer.transaction(conn):
                inbox.install(conn)
    with connect() as conn, sync_writer(conn).transaction(conn):
        sync_writer(conn).run(conn, EFFECTS)
    failed: set[str] = set()

    def handle(delivery: FakeDelivery, conn: Any) -> None:
        sync_writer(conn).run(conn, "INSERT INTO effects VALUES (%s)", (delivery.message_id,))
        if delivery.message_id == "m3" and "m3" not in failed:
            failed.add("m3")
            raise RuntimeError("after the claim")

    handler = inbox.handler(connect, handle)
    for delivery in DELIVERIES:
        with contextlib.suppress(RuntimeError):
            handler(delivery)
    handler(FakeDelivery("m3", redelivered=True))
    with connect() as conn:
        writer = sync_writer(conn)
        rows = writer.fetch(conn, "SELECT message_id FROM effects ORDER BY message_id")
        assert [r[0] for r in rows] == IDS
    assert inbox.record_attempt(factory, FakeDelivery("m9", redelivered=True)) == 2
    assert inbox.record_attempt(factory, FakeDelivery("m9", redelivered=True)) == 3
    with connect() as conn:
        assert inbox.prune(conn, older_than=0) == len(IDS) + 1  # claims, and m9's ledger row
        assert not sync_writer(conn).in_transaction(conn)  # each batch committed


def test_sqlalchemy_session_on_postgresql(pg_dsn: str) -> None:
    engine = sa.create_engine(_url(pg_dsn, "psycopg"))
    factory = sessionmaker(engine)
    _sync_scenario(factory, factory)
    with factory() as session, pytest.raises(ConfigurationError, match=r"claim\(\)"):
        Inbox("svc").claim(
            session.connection(execution_options={"isolation_level": "AUTOCOMMIT"}),
            FakeDelivery("x"),
        )
    engine.dispose()


def test_sqlalchemy_connection_on_sqlite(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    _sync_scenario(engine.connect, engine.connect)
    engine.dispose()


def test_sqlalchemy_session_on_mariadb(mysql_dsn: str) -> None:
    engine = sa.create_engine(_url(mysql_dsn, "pymysql"))
    factory = sessionmaker(engine)
    _sync_scenario(factory, factory)
    engine.dispose()


# --- asyncio ----------------------------------------------------------------------------------


async def _async_scenario(connect: Callable[[], Any], factory: Callable[[], Any]) -> None:
    inbox = AsyncInbox("svc")

    @contextlib.asynccontextmanager
    async def opened() -> Any:
        made = connect()
        if hasattr(made, "__aenter__"):
            async with made as conn:
                yield conn
        else:
            conn = await made
            try:
                yield conn
            finally:
                await conn.close()

    for _ in range(2):
        async with opened() as conn, async_writer(conn).transaction(conn):
            await inbox.install(conn)
    async with opened() as conn, async_writer(conn).transaction(conn):
        await async_writer(conn).run(conn, EFFECTS)
    failed: set[str] = set()

    async def handle(delivery: FakeDelivery, conn: Any) -> None:
        await async_writer(conn).run(
            conn, "INSERT INTO effects VALUES (%s)", (delivery.message_id,)
        )
        if delivery.message_id == "m3" and "m3" not in failed:
            failed.add("m3")
            raise RuntimeError("after the claim")

    handler = inbox.handler(connect, handle)
    for delivery in DELIVERIES:
        with contextlib.suppress(RuntimeError):
            await handler(delivery)
    await handler(FakeDelivery("m3", redelivered=True))
    async with opened() as conn:
        rows = await async_writer(conn).fetch(
            conn, "SELECT message_id FROM effects ORDER BY message_id"
        )
        assert [r[0] for r in rows] == IDS
        if async_writer(conn).in_transaction(conn):
            await conn.rollback()  # a session's read began a transaction
    assert await inbox.record_attempt(factory, FakeDelivery("m9", redelivered=True)) == 2
    async with opened() as conn:
        assert await inbox.prune(conn, older_than=0) == len(IDS) + 1


def test_sqlalchemy_async_session_on_asyncpg(pg_dsn: str) -> None:
    async def main() -> None:
        engine = create_async_engine(_url(pg_dsn, "asyncpg"))
        factory = async_sessionmaker(engine, class_=AsyncSession)
        await _async_scenario(factory, factory)
        await engine.dispose()

    asyncio.run(main())


def test_sqlalchemy_async_connection_on_psycopg(pg_dsn: str) -> None:
    async def main() -> None:
        engine = create_async_engine(_url(pg_dsn, "psycopg"))
        await _async_scenario(engine.connect, engine.connect)
        await engine.dispose()

    asyncio.run(main())


def test_psycopg_async_connection(pg_dsn: str) -> None:
    async def main() -> None:
        def connect() -> Any:
            return psycopg.AsyncConnection.connect(pg_dsn)

        await _async_scenario(connect, connect)
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            with pytest.raises(ConfigurationError, match=r"claim\(\).*autocommit"):
                await AsyncInbox("svc").claim(conn, FakeDelivery("x"))

    asyncio.run(main())


def test_asyncpg_connection_and_pool(pg_dsn: str) -> None:
    async def main() -> None:
        pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
        await _async_scenario(pool.acquire, lambda: asyncpg.connect(pg_dsn))
        async with pool.acquire() as conn:
            with pytest.raises(ConfigurationError, match=r"claim\(\).*transaction"):
                await AsyncInbox("svc").claim(conn, FakeDelivery("x"))  # outside transaction()
        await pool.close()

    asyncio.run(main())


# --- Django -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_django_connection_in_atomic(kind: str, tmp_path: Path, request: Any) -> None:
    db = str(tmp_path / "django.db") if kind == "sqlite" else request.getfixturevalue("pg_dsn")
    env = {
        **os.environ,
        "INBOX_DJANGO_DB": db,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(HERE / "django_inbox.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report == {"effects": IDS, "refused": True, "pruned": len(IDS), "attempt": 2}
