"""asyncpg: the writer for an asyncpg ``Connection`` (or a pool's connection), inside the caller's
``async with conn.transaction():``. Moves rows; decides nothing.

asyncpg has no implicit transactions: outside ``transaction()`` every statement commits on its
own, so a write there is refused. A row and its wake-up (``pg_notify``) go in one statement
(prepared once per connection by asyncpg's statement cache), as the psycopg writer does.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._adapters import marks
from reliable_amqp.outbox._rows import RowValues
from reliable_amqp.outbox._schema import WRITE_COLUMNS, Tables, postgresql_ddl

asyncpg: Any
try:
    asyncpg = importlib.import_module("asyncpg")
    importlib.import_module("asyncpg.pool")
except ImportError:  # pragma: no cover - chosen by the connection's class, so asyncpg is there
    asyncpg = None

__all__ = ["async_writer"]

#: rows per statement of add_many() (10 parameters a row, PostgreSQL takes 65,535)
_CHUNK = 1000


@functools.lru_cache(maxsize=256)
def insert_sql(tables: Tables, count: int, notify: bool) -> str:
    """``count`` rows in one statement (``$n`` parameters), with the wake-up when ``notify``."""
    width = len(WRITE_COLUMNS)
    values = ", ".join(
        "(" + ", ".join(f"${r * width + c + 1}" for c in range(width)) + ")" for r in range(count)
    )
    insert = f"INSERT INTO {tables.name} ({', '.join(WRITE_COLUMNS)}) VALUES {values}"
    if not notify:
        return insert
    return f"WITH _ AS ({insert}) SELECT pg_notify('{tables.channel}', '')"


def check_writable(conn: Any, what: str = "add()") -> None:
    """Refuse a connection outside a transaction (each statement would commit on its own)."""
    if conn.is_closed():
        raise ConfigurationError(f"{what}: the connection is closed")
    if not conn.is_in_transaction():
        raise ConfigurationError(
            f"{what}: this asyncpg connection has no transaction open, so the row would commit "
            "on its own, not with your transaction: write inside `async with conn.transaction():`"
        )


class _AsyncWriter:
    """asyncpg ``Connection``: one statement a row (inserting and notifying), one per 1,000 rows
    for ``add_many()``."""

    def dialect(self, conn: Any) -> str:
        return "postgresql"

    async def run(
        self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None
    ) -> int:
        if check:
            check_writable(conn, check)
        # asyncpg answers with the command tag ("INSERT 0 1", "DELETE 5", "CREATE TABLE")
        tag = await conn.execute(marks(sql, "numeric_dollar"), *params)
        count = str(tag).rsplit(" ", 1)[-1]
        return int(count) if count.isdigit() else 0

    async def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await conn.fetch(marks(sql, "numeric_dollar"), *params)]

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.is_in_transaction())

    def transaction(self, conn: Any) -> Any:
        return conn.transaction()

    async def install(self, conn: Any, tables: Tables) -> None:
        for statement in postgresql_ddl(tables):
            await conn.execute(statement)

    async def write(
        self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool
    ) -> None:
        check_writable(conn)
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start : start + _CHUNK]
            await conn.execute(
                insert_sql(tables, len(chunk), notify), *[v for row in chunk for v in row]
            )


def async_writer(conn: object) -> _AsyncWriter | None:
    """The writer for an asyncpg ``Connection`` or a pool's connection (None otherwise)."""
    if asyncpg is not None and isinstance(
        conn, (asyncpg.Connection, asyncpg.pool.PoolConnectionProxy)
    ):
        return _AsyncWriter()
    return None
