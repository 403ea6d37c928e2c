"""The relay's side of each database: what a relay needs of one (:class:`RelayStore`), the store
for a DSN, and which errors mean "the database went away" (the relay reconnects) rather than a
bug or a misconfiguration."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Protocol, cast

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._rows import PendingRow
from reliable_amqp.outbox._schema import Tables
from reliable_amqp.outbox._status import OpenWriter


class RelayStore(Protocol):
    """What the relay needs of a database (``_pg.PgRelayStore``,
    ``_sqlite.SqliteRelayStore``, ``_mysql.MysqlRelayStore``)."""

    dialect: str

    def connect(self) -> None: ...
    @property
    def connected(self) -> bool: ...
    def close(self) -> None: ...
    def drop(self) -> None: ...
    def start_wakeups(self, wake: threading.Event) -> None: ...
    def relays(self) -> int: ...
    def try_lock(self, parts: Sequence[int], want: int) -> list[int]: ...
    def unlock(self, parts: Sequence[int]) -> None: ...
    def read(
        self, after: int, parts: Sequence[int] | None, skip: Sequence[int], limit: int
    ) -> list[PendingRow]: ...
    def delete(self, ids: Sequence[int]) -> None: ...
    def fail(self, failures: Sequence[tuple[int, int, str]]) -> None: ...
    def any_pending(self) -> bool: ...
    def backlog(self, cap: int) -> tuple[int, float | None]: ...
    def open_writers(self) -> list[OpenWriter]: ...


def database_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the database is unreachable or went away" (retried)."""
    import sqlite3

    errors: list[type[BaseException]] = [sqlite3.OperationalError]
    try:
        import psycopg

        errors += [psycopg.OperationalError, psycopg.InterfaceError]
    except ImportError:
        pass
    try:
        import pymysql

        # OperationalError: the server went away, refused us, or a lock wait or deadlock ended
        # a statement; InterfaceError: the connection is closed already
        errors += [pymysql.err.OperationalError, pymysql.err.InterfaceError]
    except ImportError:
        pass
    return tuple(errors)


def open_store(db: str, tables: Tables, name: str) -> RelayStore:
    """The store for a DSN: ``postgresql://...`` (or ``postgres://``), ``mysql://...`` (or
    ``mariadb://``) or ``sqlite:///path``."""
    if not isinstance(db, str):
        raise ConfigurationError(f"db: expected a DSN string, got {type(db).__name__}")
    if db.startswith(("postgresql://", "postgres://")):
        from reliable_amqp.outbox._pg import PgRelayStore, require_psycopg

        require_psycopg()
        return PgRelayStore(db, tables, name)
    if db.startswith("sqlite:///"):
        from reliable_amqp.outbox._sqlite import SqliteRelayStore, path_of

        return SqliteRelayStore(path_of(db), tables, name)
    if db.startswith(("mysql://", "mariadb://")):
        mysql = importlib.import_module("reliable_amqp.outbox._mysql")
        return cast(RelayStore, mysql.MysqlRelayStore(db, tables, name))
    raise ConfigurationError(
        "db: expected postgresql://user@host:port/dbname, mysql://user@host:port/dbname or "
        "sqlite:///path/to/file.db, got "
        f"{db.split('://', 1)[0] + '://...' if '://' in db else 'a string without a scheme'}"
    )
