"""SQLAlchemy 2: the writer for a ``Session`` or ``Connection`` (sync) and an ``AsyncSession`` or
``AsyncConnection`` (asyncio), on any dialect the outbox has a relay for (PostgreSQL through
psycopg or asyncpg, SQLite, MySQL and MariaDB through PyMySQL). Moves rows; decides nothing.

The write joins the session's transaction (``session.connection()``, which begins it if the
session has not yet) and never commits: the application's ``commit()`` or ``rollback()`` decides.
The insert is SQLAlchemy Core on the outbox's :func:`~reliable_amqp.outbox.sqlalchemy.outbox_table`
(compiled once per dialect, then taken from SQLAlchemy's statement cache); on PostgreSQL, a
single row and its wake-up (``pg_notify``) go in one statement, as the psycopg writer does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._adapters import marks
from reliable_amqp.outbox._rows import RowValues
from reliable_amqp.outbox._schema import (
    WRITE_COLUMNS,
    Tables,
    mysql_ddl,
    postgresql_ddl,
    sqlite_ddl,
)
from reliable_amqp.outbox.sqlalchemy import outbox_table

__all__ = ["async_writer", "sync_writer"]

#: rows per statement of add_many() (SQLAlchemy's insertmanyvalues batches them further)
_CHUNK = 1000


@functools.lru_cache(maxsize=64)
def _table(tables: Tables) -> sa.Table:
    return outbox_table(sa.MetaData(), tables.name)


@functools.lru_cache(maxsize=64)
def _insert(tables: Tables) -> sa.Insert:
    """INSERT of one row, its values passed at execution (a dict by column name)."""
    return sa.insert(_table(tables))


@functools.lru_cache(maxsize=64)
def _insert_notify(tables: Tables) -> sa.Select[Any]:
    """PostgreSQL: ``WITH _ AS (INSERT ...) SELECT pg_notify(channel, '')``, one round trip."""
    table = _table(tables)
    values: dict[str, Any] = {column: sa.bindparam(f"v_{column}") for column in WRITE_COLUMNS}
    insert = sa.insert(table).values(values).cte("_")
    return sa.select(_notify_call(tables)).add_cte(insert)


def _notify_call(tables: Tables) -> Any:
    return sa.func.pg_notify(sa.literal(tables.channel), sa.literal(""))


@functools.lru_cache(maxsize=64)
def _notify(tables: Tables) -> sa.Select[Any]:
    return sa.select(_notify_call(tables))


def _dicts(rows: Sequence[RowValues]) -> list[dict[str, Any]]:
    return [dict(zip(WRITE_COLUMNS, row, strict=True)) for row in rows]


def check_writable(conn: Connection, what: str = "add()") -> None:
    """Refuse a connection whose write would commit on its own: isolation level AUTOCOMMIT (on
    the engine or the connection), where ``begin()`` and ``commit()`` do nothing."""
    if conn.closed or conn.invalidated:
        raise ConfigurationError(f"{what}: the connection is closed")
    autocommit = getattr(conn, "_is_autocommit_isolation", None)
    if autocommit is not None and autocommit():
        raise ConfigurationError(
            f"{what}: this SQLAlchemy connection runs with isolation_level='AUTOCOMMIT', so the "
            "row would commit on its own, not with your transaction: write through a session or "
            "connection with a transactional isolation level"
        )


def install(conn: Connection, tables: Tables) -> None:
    """The outbox's tables, as ``install()`` creates them on this dialect (the library's DDL
    where it has one, else the exported Table), on the caller's connection."""
    ddl = _DDL.get(conn.dialect.name)
    if ddl is None:
        _table(tables).metadata.create_all(conn, checkfirst=True)
        return
    for statement in ddl(tables):
        conn.exec_driver_sql(statement)


_DDL = {
    "postgresql": postgresql_ddl,
    "sqlite": sqlite_ddl,
    "mysql": mysql_ddl,
    "mariadb": mysql_ddl,
}


def write(conn: Connection, tables: Tables, rows: Sequence[RowValues], notify: bool) -> None:
    """Insert ``rows`` on ``conn`` (in its transaction, begun if it had none)."""
    check_writable(conn)
    dialect = conn.dialect.name
    if dialect == "postgresql" and notify and len(rows) == 1:
        conn.execute(
            _insert_notify(tables),
            {f"v_{c}": v for c, v in zip(WRITE_COLUMNS, rows[0], strict=True)},
        )
        return
    insert = _insert(tables)
    if len(rows) == 1:
        conn.execute(insert, dict(zip(WRITE_COLUMNS, rows[0], strict=True)))
    else:
        for start in range(0, len(rows), _CHUNK):
            conn.execute(insert, _dicts(rows[start : start + _CHUNK]))
    if notify:
        if dialect == "postgresql":
            conn.execute(_notify(tables))
        elif dialect == "sqlite":
            from reliable_amqp.outbox._sqlite import wake_local

            wake_local()
        elif dialect in {"mysql", "mariadb"}:
            from reliable_amqp.outbox import _mysql

            _mysql.wake_local()


def _connection(conn: Any) -> Connection:
    return conn.connection() if isinstance(conn, Session) else conn


@functools.lru_cache(maxsize=256)
def _text(sql: str) -> sa.TextClause:
    """A statement written with ``%s`` marks as SQLAlchemy text (``:p0``...), compiled for
    each dialect's driver by SQLAlchemy."""
    return sa.text(marks(sql, "named"))


def run(conn: Connection, sql: str, params: Sequence[Any], check: str | None = None) -> int:
    """Execute one statement on ``conn`` (in its transaction, begun if it had none)."""
    if check:
        check_writable(conn, check)
    result = conn.execute(_text(sql), {f"p{i}": v for i, v in enumerate(params)})
    return int(result.rowcount)


def fetch(conn: Connection, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    result = conn.execute(_text(sql), {f"p{i}": v for i, v in enumerate(params)})
    return [tuple(row) for row in result.fetchall()]


def _dialect_of(conn: Any) -> str:
    """The dialect's name, without beginning a Session's transaction (MariaDB as mysql)."""
    bind = conn.get_bind() if hasattr(conn, "get_bind") else conn
    name = str(bind.dialect.name)
    return "mysql" if name == "mariadb" else name


class _Writer:
    """SQLAlchemy ``Session`` (its connection, in its transaction) or ``Connection``."""

    def dialect(self, conn: Any) -> str:
        return _dialect_of(conn)

    def run(self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None) -> int:
        return run(_connection(conn), sql, params, check)

    def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return fetch(_connection(conn), sql, params)

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.in_transaction())

    def transaction(self, conn: Any) -> Any:
        return conn.begin()  # a Session's or a Connection's: commits at a clean exit

    def install(self, conn: Any, tables: Tables) -> None:
        install(_connection(conn), tables)

    def write(self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool) -> None:
        write(_connection(conn), tables, rows, notify)


class _AsyncWriter:
    """SQLAlchemy ``AsyncSession`` or ``AsyncConnection``: the sync writer, run on the
    connection's greenlet (as SQLAlchemy runs every statement of its asyncio API)."""

    def dialect(self, conn: Any) -> str:
        sync = conn.sync_session if hasattr(conn, "sync_session") else conn.sync_engine
        return _dialect_of(sync)

    async def run(
        self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None
    ) -> int:
        connection = await _async_connection(conn)
        return int(await connection.run_sync(run, sql, params, check))

    async def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        connection = await _async_connection(conn)
        return list(await connection.run_sync(fetch, sql, params))

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.in_transaction())

    def transaction(self, conn: Any) -> Any:
        return conn.begin()  # an AsyncSession's or an AsyncConnection's, entered with async with

    async def install(self, conn: Any, tables: Tables) -> None:
        connection = await _async_connection(conn)
        await connection.run_sync(install, tables)

    async def write(
        self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool
    ) -> None:
        connection = await _async_connection(conn)
        await connection.run_sync(write, tables, rows, notify)


async def _async_connection(conn: Any) -> Any:
    from sqlalchemy.ext.asyncio import AsyncSession

    if isinstance(conn, AsyncSession):
        return await conn.connection()
    return conn


def sync_writer(conn: object) -> _Writer | None:
    """The writer for a SQLAlchemy ``Session`` or ``Connection`` (None for anything else)."""
    return _Writer() if isinstance(conn, (Session, Connection)) else None


def async_writer(conn: object) -> _AsyncWriter | None:
    """The writer for a SQLAlchemy ``AsyncSession`` or ``AsyncConnection`` (None otherwise)."""
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    except ImportError:  # pragma: no cover - SQLAlchemy without its asyncio part
        return None
    return _AsyncWriter() if isinstance(conn, (AsyncSession, AsyncConnection)) else None
