"""Operator tools on an outbox by DSN (what ``reliable-amqp outbox`` runs): create it, look at
it, and deal with its failed rows. Each opens a connection of its own and commits its work."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox import _sqlite
from reliable_amqp.outbox._schema import (
    DEFAULT_TABLE,
    WRITE_COLUMNS,
    Tables,
    mysql_columns,
    mysql_quote,
)
from reliable_amqp.outbox._status import OutboxStatus


@dataclass(frozen=True)
class FailedRow:
    """A row the broker refused for good, as the failed table holds it."""

    id: int
    message_id: str
    key: str | None
    exchange: str
    routing_key: str
    record: bytes
    body: bytes
    created_at: float
    failed_at: float
    attempts: int
    reason: str


@contextlib.contextmanager
def connect(db: str) -> Iterator[tuple[str, Any]]:
    """(dialect, connection) for a DSN; the connection commits when the block ends well."""
    # The drivers' modules are imported for their own DSNs only: importing the outbox (or using
    # it on SQLite) imports neither psycopg nor PyMySQL (tests/outbox/test_imports.py).
    if db.startswith(("postgresql://", "postgres://")):
        from reliable_amqp.outbox import _pg

        pg = _pg.require_psycopg()
        with pg.connect(db) as conn:  # commits on a clean exit, rolls back otherwise
            yield "postgresql", conn
        return
    if db.startswith("sqlite:///"):
        path = _sqlite.path_of(db)
        conn = sqlite3.connect(path, timeout=_sqlite.BUSY_TIMEOUT)
        try:
            with conn:  # commits on a clean exit
                yield "sqlite", conn
        finally:
            conn.close()
        return
    if db.startswith(("mysql://", "mariadb://")):
        from reliable_amqp.outbox import _mysql

        with _mysql.tool_connection(db) as tool:  # commits on a clean exit
            yield "mysql", tool
        return
    raise ConfigurationError(
        "--db: expected postgresql://user@host:port/dbname, mysql://user@host:port/dbname or "
        "sqlite:///path/to/file.db"
    )


def _names(dialect: str, tables: Tables, columns: Sequence[str]) -> tuple[str, str, str]:
    """(table, failed table, column list) as the dialect spells them (``key`` is reserved on
    MariaDB and MySQL)."""
    if dialect == "mysql":
        return mysql_quote(tables.name), mysql_quote(tables.failed), mysql_columns(columns)
    return tables.name, tables.failed, ", ".join(columns)


def install(db: str, table: str = DEFAULT_TABLE) -> None:
    """Create the outbox's tables if missing (``outbox init``)."""
    tables = Tables.named(table)
    with connect(db) as (dialect, conn):
        if dialect == "sqlite":
            _sqlite.install(conn, tables)
        elif dialect == "mysql":
            from reliable_amqp.outbox import _mysql

            _mysql.install(conn.raw, tables)
        else:
            from reliable_amqp.outbox import _pg

            _pg.install(conn, tables)


def status(db: str, table: str = DEFAULT_TABLE) -> OutboxStatus:
    """Pending and failed counts, the oldest age, the relays at work and the open writers."""
    tables = Tables.named(table)
    with connect(db) as (dialect, conn):
        if dialect == "sqlite":
            pending, failed, oldest, relays = _sqlite.status_rows(conn, tables, _sqlite.path_of(db))
            writers = []
        elif dialect == "mysql":
            from reliable_amqp.outbox import _mysql

            database = _mysql.database_of(_mysql.connect_args(db), tables)
            _mysql.check_tables(conn.raw, tables, database)
            pending, failed, oldest, relays, sessions = _mysql.status_rows(
                conn.raw, tables, database
            )
            writers = _mysql.open_writers(conn.raw, database, sessions)
        else:
            from reliable_amqp.outbox import _pg

            pending, failed, oldest, relays = _pg.status_rows(conn, tables)
            writers = _pg.open_writers(conn, tables)
    ages = [time.time() - oldest] if oldest is not None else []
    ages += [w.age_s for w in writers]
    return OutboxStatus(
        pending=pending,
        failed=failed,
        oldest_age_s=max(ages) if ages else None,
        relays=relays,
        open_writers=writers,
    )


def failed_rows(db: str, table: str = DEFAULT_TABLE) -> list[FailedRow]:
    """The failed rows, oldest first."""
    tables = Tables.named(table)
    columns = ("id", "message_id", "key", "exchange", "routing_key", "record", "body",
               "created_at", "failed_at", "attempts", "reason")  # fmt: skip
    with connect(db) as (dialect, conn):
        _table, failed, cols = _names(dialect, tables, columns)
        rows = conn.execute(f"SELECT {cols} FROM {failed} ORDER BY id").fetchall()
    return [
        FailedRow(int(r[0]), r[1], r[2], r[3], r[4], bytes(r[5]), bytes(r[6]), float(r[7]),
                  float(r[8]), int(r[9]), r[10])
        for r in rows
    ]  # fmt: skip


def _where(ids: Sequence[str] | None, dialect: str) -> tuple[str, list[Any]]:
    if ids is None:
        return "", []
    mark = "?" if dialect == "sqlite" else "%s"
    # MariaDB and MySQL: utf8mb4_bin ignores trailing spaces (PAD SPACE), so 'm-1' would also
    # take 'm-1 '; a binary string compares every byte
    column = "CAST(message_id AS BINARY)" if dialect == "mysql" else "message_id"
    return f" WHERE {column} IN ({', '.join([mark] * len(ids))})", list(ids)


def retry_failed(
    db: str, table: str = DEFAULT_TABLE, message_ids: Sequence[str] | None = None
) -> int:
    """Move failed rows (all, or those with these message ids) back to the outbox, in their
    order, with their message ids; they are published after the rows pending now. How many."""
    tables = Tables.named(table)
    with connect(db) as (dialect, conn):
        pending, failed, cols = _names(dialect, tables, WRITE_COLUMNS)
        where, params = _where(message_ids, dialect)
        cur = conn.execute(
            f"INSERT INTO {pending} ({cols}) SELECT {cols} FROM {failed}{where} ORDER BY id",
            params,
        )
        moved = cur.rowcount
        conn.execute(f"DELETE FROM {failed}{where}", params)
        if dialect == "postgresql":
            conn.execute(f"SELECT pg_notify('{tables.channel}', '')")
    return int(moved)


def drop_failed(
    db: str, table: str = DEFAULT_TABLE, message_ids: Sequence[str] | None = None
) -> int:
    """Delete failed rows (all, or those with these message ids); how many."""
    tables = Tables.named(table)
    with connect(db) as (dialect, conn):
        _pending, failed, _cols = _names(dialect, tables, ())
        where, params = _where(message_ids, dialect)
        cur = conn.execute(f"DELETE FROM {failed}{where}", params)
        return int(cur.rowcount)
