"""Django: the writer for ``django.db.connection`` (or ``connections[alias]``) inside
``transaction.atomic()``, on PostgreSQL, SQLite and MySQL/MariaDB. Moves rows; decides nothing.

The write runs on a cursor of the caller's connection, so it joins the ``atomic()`` block (or
the transaction a ``ATOMIC_REQUESTS`` view runs in) and never commits. With autocommit on and no
``atomic()`` open, Django commits every statement on its own: such a write is refused. The
tables come from the app ``reliable_amqp.outbox.django`` (its migration) or ``install()``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._rows import RowValues
from reliable_amqp.outbox._schema import (
    WRITE_COLUMNS,
    Tables,
    mysql_columns,
    mysql_ddl,
    mysql_quote,
    postgresql_ddl,
    sqlite_ddl,
)

__all__ = ["ddl_for", "sync_writer"]


@functools.lru_cache(maxsize=64)
def insert_sql(tables: Tables, vendor: str, notify: bool) -> str:
    """One row's INSERT in Django's ``%s`` style (PostgreSQL: with its wake-up)."""
    marks = ", ".join(["%s"] * len(WRITE_COLUMNS))
    if vendor == "mysql":
        table, columns = mysql_quote(tables.name), mysql_columns(WRITE_COLUMNS)
    else:
        table, columns = tables.name, ", ".join(WRITE_COLUMNS)
    insert = f"INSERT INTO {table} ({columns}) VALUES ({marks})"
    if vendor == "postgresql" and notify:
        return f"WITH _ AS ({insert}) SELECT pg_notify('{tables.channel}', '')"
    return insert


def ddl_for(vendor: str, tables: Tables) -> list[str]:
    """The statements ``install()`` runs on a Django database of ``vendor``."""
    make = {"postgresql": postgresql_ddl, "sqlite": sqlite_ddl, "mysql": mysql_ddl}.get(vendor)
    if make is None:
        raise ConfigurationError(
            f"the outbox has no relay for Django's {vendor!r} backend (PostgreSQL, SQLite, "
            "MySQL and MariaDB)"
        )
    return make(tables)


def check_writable(conn: Any, what: str = "add()") -> None:
    """Refuse a connection whose write would commit on its own: autocommit on (Django's
    default) and no ``transaction.atomic()`` open."""
    if conn.get_autocommit() and not conn.in_atomic_block:
        raise ConfigurationError(
            f"{what}: Django's connection is in autocommit mode with no transaction.atomic() "
            "open, so the row would commit on its own, not with your transaction: write inside "
            "`with transaction.atomic():` (or a view run with ATOMIC_REQUESTS)"
        )


class _Writer:
    """Django's ``connection``: one statement a row through a cursor of the connection
    (``executemany`` for ``add_many()``)."""

    def dialect(self, conn: Any) -> str:
        return str(conn.vendor)  # "postgresql", "sqlite", "mysql" (MariaDB too), ...

    def run(self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None) -> int:
        if check:
            check_writable(conn, check)
        with conn.cursor() as cursor:
            cursor.execute(sql, tuple(params) or None)
            return int(cursor.rowcount)

    def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with conn.cursor() as cursor:
            cursor.execute(sql, tuple(params) or None)
            return [tuple(row) for row in cursor.fetchall()]

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.in_atomic_block or not conn.get_autocommit())

    def transaction(self, conn: Any) -> Any:
        from django.db import transaction

        return transaction.atomic(using=conn.alias)

    def install(self, conn: Any, tables: Tables) -> None:
        with conn.cursor() as cursor:
            for statement in ddl_for(conn.vendor, tables):
                cursor.execute(statement)

    def write(self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool) -> None:
        check_writable(conn)
        vendor = conn.vendor
        with conn.cursor() as cursor:
            if len(rows) == 1:
                cursor.execute(insert_sql(tables, vendor, notify), rows[0])
            else:
                cursor.executemany(insert_sql(tables, vendor, False), rows)
                if notify and vendor == "postgresql":
                    cursor.execute(f"SELECT pg_notify('{tables.channel}', '')")
        if notify and vendor == "sqlite":
            from reliable_amqp.outbox._sqlite import wake_local

            wake_local()
        elif notify and vendor == "mysql":
            from reliable_amqp.outbox import _mysql

            _mysql.wake_local()


def sync_writer(conn: object) -> _Writer | None:
    """The writer for Django's ``connection`` or one of ``connections`` (None otherwise)."""
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.utils.connection import ConnectionProxy

    return _Writer() if isinstance(conn, (ConnectionProxy, BaseDatabaseWrapper)) else None
