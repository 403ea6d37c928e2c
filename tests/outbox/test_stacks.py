"""The outbox where applications write: SQLAlchemy (``Session``, ``AsyncSession`` over asyncpg),
a bare asyncpg connection and Django's ``transaction.atomic()``, against the real PostgreSQL and
the local RabbitMQ. For each: hundreds of transactions, a share of them rolled back, give exactly
the committed ids in the queue. And the schema each stack manages: the exported SQLAlchemy
``Table`` matches what ``install()`` creates (Alembic's autogenerate finds nothing to change)
and autogenerates a migration that creates it; the Django app's migration applies on a fresh
database and its ``outbox_relay`` command relays."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata, produce_migrations, render_python_code
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from reliable_amqp import ConfigurationError
from reliable_amqp.outbox import AsyncOutbox, Outbox, status
from reliable_amqp.outbox.sqlalchemy import failed_table, outbox_table
from support.broker import BrokerAdmin
from support.outbox import RelayThread, mysql_database, pg_database, read_ids, wait_for_count

DJANGO_PROJECT = Path(__file__).resolve().parent / "django_project"
SRC = Path(__file__).resolve().parents[2] / "src"

#: transactions per stack, and the share rolled back
TRANSACTIONS = 400
ROLLBACK = 0.25


def _url(dsn: str, driver: str) -> str:
    """A SQLAlchemy URL for a test database's DSN, through ``driver``."""
    scheme, rest = dsn.split("://", 1)
    return f"{scheme}+{driver}://{rest}"


def _dsn(engine: sa.Engine) -> str:
    """The relay's DSN for a SQLAlchemy engine."""
    url = engine.url.render_as_string(hide_password=False)
    return url.replace(f"+{engine.url.drivername.split('+')[1]}", "", 1) if "+" in url else url


def _orders(metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("note", sa.Text, nullable=False),
    )


def _drained(broker: BrokerAdmin, queue: str, committed: list[str]) -> list[str]:
    """The queue's message ids once it holds as many as were committed (or more)."""
    assert wait_for_count(broker, queue, len(committed), 60) >= len(committed)
    return [mid for mid, _ in read_ids(broker, queue)]


@pytest.fixture
def queue(broker: BrokerAdmin) -> str:
    return broker.queue()


# --- SQLAlchemy, sync -------------------------------------------------------------------------


@pytest.mark.broker
def test_sqlalchemy_session_gives_exactly_the_committed_rows(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, queue: str
) -> None:
    engine = sa.create_engine(_url(pg_dsn, "psycopg"))
    metadata = sa.MetaData()
    orders = _orders(metadata)
    outbox_table(metadata)
    outbox = Outbox()
    with Session(engine) as session:
        outbox.install(session)
        outbox.install(session)  # idempotent
        metadata.create_all(session.connection(), tables=[orders])
        session.commit()
    committed: list[str] = []
    lock = threading.Lock()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(TRANSACTIONS // 2):
            with Session(engine) as session:
                session.execute(sa.insert(orders).values(id=seed * 10_000 + i, note="x"))
                mid = outbox.add(session, "", queue, b"%d" % i, key=f"k{i % 10}")
                if rng.random() < ROLLBACK:
                    session.rollback()
                    continue
                session.commit()
            with lock:
                committed.append(mid)

    with RelayThread(pg_dsn, amqp_url) as relay:
        threads = [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        got = _drained(broker, queue, committed)
    assert relay.error is None
    assert 0.6 * TRANSACTIONS < len(committed) < 0.9 * TRANSACTIONS
    assert sorted(got) == sorted(committed)
    with engine.connect() as conn:  # the orders and their events went together
        assert conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar() == len(
            committed
        )
    engine.dispose()


@pytest.mark.broker
def test_sqlalchemy_session_on_mariadb_gives_exactly_the_committed_rows(
    amqp_url: str, broker: BrokerAdmin, queue: str
) -> None:
    with mysql_database() as dsn:
        engine = sa.create_engine(_url(dsn, "pymysql"))
        outbox = Outbox()
        with Session(engine) as session:
            outbox.install(session)
            session.commit()
        committed: list[str] = []
        rng = random.Random(3)
        with RelayThread(dsn, amqp_url) as relay:
            for i in range(TRANSACTIONS // 2):
                with Session(engine) as session:
                    mid = outbox.add(session, "", queue, b"%d" % i, key=f"k{i % 10}")
                    if rng.random() < ROLLBACK:
                        session.rollback()
                        continue
                    session.commit()
                committed.append(mid)
            got = _drained(broker, queue, committed)
        engine.dispose()
    assert relay.error is None
    assert sorted(got) == sorted(committed)


def test_sqlalchemy_connection_joins_its_transaction_and_autocommit_is_refused(
    tmp_path: Path,
) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    outbox = Outbox()
    with engine.begin() as conn:
        outbox.install(conn)
    with engine.connect() as conn:
        kept = outbox.add(conn, "", "q", b"kept")
        conn.commit()
        outbox.add_many(conn, [{"exchange": "", "routing_key": "q", "body": b"gone"}] * 3)
        conn.rollback()
        with conn.begin():
            nested = outbox.add_many(
                conn, [{"exchange": "", "routing_key": "q", "body": b"many"}] * 2
            )
    with engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT message_id FROM amqp_outbox ORDER BY id")).all()
    assert [r[0] for r in ids] == [kept, *nested]
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    with Session(auto) as session, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        outbox.add(session, "", "q", b"x")
    with pytest.raises(ConfigurationError, match="AsyncOutbox"):
        outbox.add(AsyncSession(), "", "q", b"x")
    engine.dispose()


# --- SQLAlchemy, asyncio (asyncpg) ------------------------------------------------------------


@pytest.mark.broker
def test_async_session_over_asyncpg_gives_exactly_the_committed_rows(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, queue: str
) -> None:
    metadata = sa.MetaData()
    orders = _orders(metadata)
    outbox = AsyncOutbox()
    committed: list[str] = []

    async def setup() -> None:
        engine = create_async_engine(_url(pg_dsn, "asyncpg"))
        async with AsyncSession(engine) as session:
            await outbox.install(session)
            await (await session.connection()).run_sync(metadata.create_all)
            await session.commit()
        async with engine.connect() as conn:  # an AsyncConnection: the same, without a session
            await outbox.install(conn)
            gone = await outbox.add(conn, "", queue, b"rolled back")
            await conn.rollback()
            kept = await outbox.add_many(
                conn, [{"exchange": "", "routing_key": queue, "body": b"c"}]
            )
            await conn.commit()
            ids = (await conn.execute(sa.text("SELECT message_id FROM amqp_outbox"))).scalars()
            assert list(ids) == kept and gone not in kept
        committed.extend(kept)
        await engine.dispose()

    async def main() -> None:
        engine = create_async_engine(_url(pg_dsn, "asyncpg"))

        async def handler(worker: int, rng: random.Random) -> None:
            for i in range(TRANSACTIONS // 4):
                async with AsyncSession(engine) as session:
                    session.add_all([])  # a request's session, as FastAPI's dependency makes
                    await session.execute(
                        sa.insert(orders).values(id=worker * 10_000 + i, note="x")
                    )
                    mid = await outbox.add(session, "", queue, b"%d" % i, key=f"k{i % 10}")
                    if rng.random() < ROLLBACK:
                        await session.rollback()
                        continue
                    await session.commit()
                committed.append(mid)

        await asyncio.gather(*(handler(w, random.Random(w)) for w in range(4)))
        await engine.dispose()

    asyncio.run(setup())
    with RelayThread(pg_dsn, amqp_url) as relay:
        asyncio.run(main())
        got = _drained(broker, queue, committed)
    assert relay.error is None
    assert 0.6 * TRANSACTIONS < len(committed) < 0.9 * TRANSACTIONS
    assert sorted(got) == sorted(committed)


# --- asyncpg ----------------------------------------------------------------------------------


@pytest.mark.broker
def test_a_bare_asyncpg_connection_gives_exactly_the_committed_rows(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, queue: str
) -> None:
    outbox = AsyncOutbox()
    committed: list[str] = []

    async def setup() -> None:
        conn = await asyncpg.connect(pg_dsn)
        await outbox.install(conn)
        await outbox.install(conn)
        with pytest.raises(ConfigurationError, match="transaction"):
            await outbox.add(conn, "", queue, b"outside a transaction")
        with pytest.raises(ConfigurationError, match="AsyncOutbox"):
            Outbox().add(conn, "", queue, b"sync")
        await conn.close()

    async def main() -> None:
        pool = await asyncpg.create_pool(pg_dsn, min_size=2, max_size=4)

        async def writer(worker: int) -> None:
            rng = random.Random(worker)
            for i in range(TRANSACTIONS // 4):
                async with pool.acquire() as conn:
                    tx = conn.transaction()
                    await tx.start()
                    if i % 20 == 0:
                        ids = await outbox.add_many(
                            conn,
                            [{"exchange": "", "routing_key": queue, "body": b"m"}] * 3,
                        )
                    else:
                        ids = [await outbox.add(conn, "", queue, b"%d" % i, key=f"k{i}")]
                    if rng.random() < ROLLBACK:
                        await tx.rollback()
                        continue
                    await tx.commit()
                committed.extend(ids)

        await asyncio.gather(*(writer(w) for w in range(4)))
        await pool.close()

    asyncio.run(setup())
    with RelayThread(pg_dsn, amqp_url) as relay:
        asyncio.run(main())
        got = _drained(broker, queue, committed)
    assert relay.error is None
    assert sorted(got) == sorted(committed)
    assert len(got) > 0.6 * TRANSACTIONS


# --- Django -----------------------------------------------------------------------------------


#: The Django versions the outbox-django extra admits, each at work: the main venv's (what pip
#: resolves on Python 3.11), and two venvs scripts/dev.sh builds beside the version matrix's:
#: Django 6 on Python 3.13 (Django 6 needs 3.12+) and the extra's lower bound on Python 3.10.
#: leg -> (venv, or None for this interpreter; the Django major.minor it must have, or None)
DJANGO_LEGS: dict[str, tuple[str | None, str | None]] = {
    "main": (None, None),
    "django6": ("venv-django6", "6."),
    "django-lowest": ("venv-django-lowest", "4.2"),
}
MATRIX_DIR = Path(
    os.environ.get("RELIABLE_AMQP_MATRIX_DIR", Path.home() / ".cache" / "reliable-amqp")
)


@pytest.fixture(scope="module", params=list(DJANGO_LEGS))
def django_python(request: pytest.FixtureRequest) -> str:
    """The interpreter of one Django leg, its venv built or checked by ``scripts/dev.sh venvs``
    (a stamp check when current; ``scripts/dev.sh test`` has built them before pytest starts)."""
    venv, version = DJANGO_LEGS[request.param]
    if venv is None:
        return sys.executable
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    built = subprocess.run(
        ["bash", str(SRC.parent / "scripts" / "dev.sh"), "venvs", request.param],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert built.returncode == 0, f"scripts/dev.sh venvs {request.param}:\n{built.stderr[-4000:]}"
    python = str(MATRIX_DIR / venv / "bin" / "python")
    shown = subprocess.run(
        [python, "-c", "import django; print(django.get_version())"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert version is not None and shown.startswith(version), (request.param, shown)
    return python


def _django(
    python: str, db: str, *args: str, amqp_url: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OUTBOX_DJANGO_DB": db,
        "AMQP_URL": amqp_url,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [python, *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, f"{args}: {result.stdout}\n{result.stderr}"
    return result


@pytest.mark.broker
def test_django_atomic_gives_exactly_the_committed_rows_and_the_command_relays(
    django_python: str, pg_dsn: str, amqp_url: str, broker: BrokerAdmin, queue: str
) -> None:
    """The app's migration on a fresh database, then hundreds of ``atomic()`` blocks (a share
    rolled back, some with a nested block), then ``manage.py outbox_relay --until-empty``."""
    written = _django(
        django_python, pg_dsn, str(DJANGO_PROJECT / "writer.py"), queue, str(TRANSACTIONS)
    )
    committed = json.loads(written.stdout.splitlines()[-1])
    assert 0.6 * TRANSACTIONS < len(committed) < TRANSACTIONS
    with psycopg.connect(pg_dsn) as conn:  # the migration made what install() makes
        assert _pg_columns(conn, "amqp_outbox") == _pg_columns_installed("amqp_outbox")
    relayed = _django(
        django_python, pg_dsn, str(DJANGO_PROJECT / "manage.py"), "outbox_relay",
        "--until-empty", amqp_url=amqp_url,
    )  # fmt: skip
    assert f"{len(committed)} confirmed, 0 failed" in relayed.stdout
    got = [mid for mid, _ in read_ids(broker, queue)]
    assert sorted(got) == sorted(committed)
    assert status(pg_dsn).pending == 0


def test_the_django_migration_applies_and_reverses_on_sqlite(
    django_python: str, tmp_path: Path
) -> None:
    db = str(tmp_path / "django.db")
    manage = str(DJANGO_PROJECT / "manage.py")
    _django(django_python, db, manage, "migrate", "-v0")
    assert status(f"sqlite:///{db}").pending == 0  # the relay's view: the tables are there
    _django(django_python, db, manage, "migrate", "reliable_amqp_outbox", "zero")
    with sqlite3.connect(db) as conn:
        names = conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'amqp%'").fetchall()
    assert names == []


def _pg_columns(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT column_name, data_type, is_nullable, is_identity, identity_generation"
        " FROM information_schema.columns WHERE table_name = %s ORDER BY ordinal_position",
        (table,),
    ).fetchall()


def _pg_columns_installed(table: str) -> list[tuple[Any, ...]]:
    with pg_database() as dsn, psycopg.connect(dsn) as conn:
        Outbox().install(conn)
        return _pg_columns(conn, table)


# --- Schema: the exported Table and Alembic ---------------------------------------------------


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sa.Engine]:
    if request.param == "sqlite":
        made = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
        yield made
        made.dispose()
        return
    if request.param == "mariadb":
        with mysql_database() as dsn:
            made = sa.create_engine(_url(dsn, "pymysql"))
            yield made
            made.dispose()
        return
    with pg_database() as dsn:
        made = sa.create_engine(_url(dsn, "psycopg"))
        yield made
        made.dispose()


def test_the_exported_table_is_what_install_creates(engine: sa.Engine) -> None:
    """After ``install()``, Alembic's autogenerate finds nothing to change against the exported
    tables: the same columns, types, nullability, primary key and identity."""
    metadata = sa.MetaData()
    table = outbox_table(metadata)
    assert outbox_table(metadata) is table
    assert failed_table(metadata).name == "amqp_outbox_failed"
    with engine.begin() as conn:
        Outbox().install(conn)
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    if engine.dialect.name == "sqlite":
        # SQLite reads `id integer PRIMARY KEY` (install()'s failed table) back as nullable,
        # though a rowid alias never holds NULL: the one difference, and not a real one
        rowid = [d for d in diffs if isinstance(d, list) and d[0][:4] == _ROWID_NULLABLE]
        assert len(rowid) == 1
        diffs = [d for d in diffs if d not in rowid]
    assert [d for d in diffs if not _identity_without_identity_columns_before_2_1(engine, d)] == []


def _identity_without_identity_columns_before_2_1(engine: sa.Engine, diff: Any) -> bool:
    """SQLAlchemy 2.0 (not 2.1) shows the pending table's ``Identity`` to Alembic as a server
    default on SQLite, MySQL and MariaDB, which have no identity columns (their
    AUTOINCREMENT/AUTO_INCREMENT is there): a difference in name only (documented)."""
    return (
        engine.dialect.name in {"sqlite", "mysql", "mariadb"}
        and sa.__version__.startswith("2.0.")
        and isinstance(diff, list)
        and diff[0][:4] == ("modify_default", None, "amqp_outbox", "id")
    )


_ROWID_NULLABLE = ("modify_nullable", None, "amqp_outbox_failed", "id")


def test_alembic_autogenerate_writes_a_migration_that_creates_the_outbox(
    engine: sa.Engine,
) -> None:
    """On an empty database, autogenerate against the application's metadata yields a migration
    creating both tables; run, it gives a database the relay accepts, and a second
    autogenerate finds nothing left to do."""
    metadata = sa.MetaData()
    outbox_table(metadata)
    with engine.connect() as conn:
        script = produce_migrations(MigrationContext.configure(conn), metadata)
    code = render_python_code(script.upgrade_ops)  # type: ignore[arg-type]
    assert "op.create_table('amqp_outbox'" in code
    assert "op.create_table('amqp_outbox_failed'" in code
    assert "sa.Identity(always=True" in code or engine.dialect.name == "sqlite"
    with engine.begin() as conn:
        op = Operations(MigrationContext.configure(conn))
        namespace: dict[str, Any] = {"op": op, "sa": sa, "mysql": mysql}
        exec(f"def upgrade():\n    {code}", namespace)  # as in the revision's file
        namespace["upgrade"]()
    with engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), metadata)
    assert [d for d in diffs if not _identity_without_identity_columns_before_2_1(engine, d)] == []
    with Session(engine) as session:  # the migrated table takes rows
        Outbox().add(session, "", "q", b"x")
        session.commit()
    assert status(_dsn(engine)).pending == 1
