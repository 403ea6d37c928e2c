"""Which adapter writes on a caller's connection: one small module per kind of connection, chosen
by the module the connection's class comes from, imported only when such a connection is used
(the library imports without SQLAlchemy, Django, asyncpg or PyMySQL).

An adapter module offers ``sync_writer(conn)`` and/or ``async_writer(conn)``, each returning a
writer for ``conn`` or None when the connection is not of its kind (psycopg's ``Connection``
against ``AsyncConnection``, say). A writer moves rows and decides nothing: the rows are checked
and built before it is called.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._rows import RowValues
from reliable_amqp.outbox._schema import Tables


class SyncWriter(Protocol):
    """Writes outbox rows on a caller's connection, in its transaction, never committing."""

    def install(self, conn: Any, tables: Tables) -> None:
        """Create the outbox's tables if missing (the caller commits)."""

    def write(self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool) -> None:
        """Insert ``rows`` (refusing a connection whose write would commit on its own)."""


class AsyncWriter(Protocol):
    """:class:`SyncWriter`, awaited."""

    async def install(self, conn: Any, tables: Tables) -> None:
        """Create the outbox's tables if missing (the caller commits)."""

    async def write(
        self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool
    ) -> None:
        """Insert ``rows`` (refusing a connection whose write would commit on its own)."""


#: the top-level package of a connection's class -> the adapter module for it
SYNC_ADAPTERS = {
    "sqlite3": "_sqlite",
    "psycopg": "_pg",
    "sqlalchemy": "_sqlalchemy",
    "django": "_django",
    "pymysql": "_mysql",
}
ASYNC_ADAPTERS = {
    "psycopg": "_pg",
    "sqlalchemy": "_sqlalchemy",
    "asyncpg": "_asyncpg",
}

_SYNC_KINDS = (
    "a psycopg 3 Connection, a sqlite3.Connection, a SQLAlchemy Session or Connection, Django's "
    "connection or a PyMySQL connection"
)
_ASYNC_KINDS = (
    "a psycopg 3 AsyncConnection, a SQLAlchemy AsyncSession or AsyncConnection, or an asyncpg "
    "Connection"
)


def _adapter(conn: object, table: dict[str, str]) -> Any:
    top = type(conn).__module__.split(".", 1)[0]
    name = table.get(top)
    if name is None:
        return None
    try:
        return importlib.import_module(f"reliable_amqp.outbox.{name}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("reliable_amqp"):
            return None  # that adapter is not written yet
        raise


#: writers found, by connection class (a writer depends on the kind of connection only)
_sync_found: dict[type, SyncWriter] = {}
_async_found: dict[type, AsyncWriter] = {}


def sync_writer(conn: object) -> SyncWriter:
    """The writer for ``conn``; :class:`~reliable_amqp.ConfigurationError` names what is taken."""
    found = _sync_found.get(type(conn))
    if found is not None:
        return found
    module = _adapter(conn, SYNC_ADAPTERS)
    writer = module.sync_writer(conn) if module is not None else None
    if writer is None:
        hint = " (it goes to AsyncOutbox)" if async_adapter_known(conn) else ""
        raise ConfigurationError(f"conn: expected {_SYNC_KINDS}, got {_name(conn)}{hint}")
    _sync_found[type(conn)] = writer
    return writer  # type: ignore[no-any-return]


def async_writer(conn: object) -> AsyncWriter:
    """The asyncio writer for ``conn``; :class:`~reliable_amqp.ConfigurationError` otherwise."""
    found = _async_found.get(type(conn))
    if found is not None:
        return found
    module = _adapter(conn, ASYNC_ADAPTERS)
    writer = (
        module.async_writer(conn)
        if module is not None and hasattr(module, "async_writer")
        else None
    )
    if writer is None:
        raise ConfigurationError(
            f"conn: AsyncOutbox takes {_ASYNC_KINDS}, got {_name(conn)} (use Outbox for a "
            "connection that is not asyncio's)"
        )
    _async_found[type(conn)] = writer
    return writer  # type: ignore[no-any-return]


def async_adapter_known(conn: object) -> bool:
    module = _adapter(conn, ASYNC_ADAPTERS)
    return (
        module is not None
        and hasattr(module, "async_writer")
        and (module.async_writer(conn) is not None)
    )


def _name(conn: object) -> str:
    return f"{type(conn).__module__}.{type(conn).__qualname__}"
