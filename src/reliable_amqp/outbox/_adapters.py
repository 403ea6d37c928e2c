"""Which adapter writes on a caller's connection: one small module per kind of connection, chosen
by the module the connection's class comes from, imported only when such a connection is used
(the library imports without SQLAlchemy, Django, asyncpg or PyMySQL).

An adapter module offers ``sync_writer(conn)`` and/or ``async_writer(conn)``, each returning a
writer for ``conn`` or None when the connection is not of its kind (psycopg's ``Connection``
against ``AsyncConnection``, say). A writer moves rows and decides nothing: the rows are checked
and built before it is called.

Besides the outbox's rows, a writer runs plain statements for the other tables kept in the
caller's database (the inbox's): ``run``/``fetch`` one statement written with ``%s`` marks (each
adapter turns them into its driver's), ``in_transaction``, and ``transaction`` (a block that
begins, commits or rolls back on an idle connection).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
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

    def dialect(self, conn: Any) -> str:
        """``postgresql``, ``sqlite`` or ``mysql`` (MariaDB too): which SQL ``conn`` speaks."""

    def run(self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None) -> int:
        """Execute one statement (``%s`` marks) as the connection stands; the rows it changed.
        With ``check`` (the caller's name, as ``"claim()"``), first refuse a connection whose
        write would commit on its own, as ``write`` does."""

    def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Execute one query (``%s`` marks) as the connection stands; its rows."""

    def in_transaction(self, conn: Any) -> bool:
        """Whether a transaction is open on ``conn``."""

    def transaction(self, conn: Any) -> AbstractContextManager[Any]:
        """A transaction on an idle ``conn``: begun on entry, committed on a clean exit, rolled
        back when the block raises."""


class AsyncWriter(Protocol):
    """:class:`SyncWriter`, awaited."""

    async def install(self, conn: Any, tables: Tables) -> None:
        """Create the outbox's tables if missing (the caller commits)."""

    async def write(
        self, conn: Any, tables: Tables, rows: Sequence[RowValues], notify: bool
    ) -> None:
        """Insert ``rows`` (refusing a connection whose write would commit on its own)."""

    def dialect(self, conn: Any) -> str:
        """As :meth:`SyncWriter.dialect`."""

    async def run(
        self, conn: Any, sql: str, params: Sequence[Any] = (), check: str | None = None
    ) -> int:
        """As :meth:`SyncWriter.run`, awaited."""

    async def fetch(self, conn: Any, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """As :meth:`SyncWriter.fetch`, awaited."""

    def in_transaction(self, conn: Any) -> bool:
        """As :meth:`SyncWriter.in_transaction`."""

    def transaction(self, conn: Any) -> AbstractAsyncContextManager[Any]:
        """As :meth:`SyncWriter.transaction`, entered with ``async with``."""


@functools.lru_cache(maxsize=256)
def marks(sql: str, style: str) -> str:
    """``sql`` written with ``%s`` marks, in a driver's paramstyle: ``format`` (as is),
    ``qmark`` (``?``), ``numeric_dollar`` (``$1``...) or ``named`` (``:p0``...)."""
    if style in {"format", "pyformat"}:
        return sql
    pieces = sql.split("%s")
    if style == "qmark":
        return "?".join(pieces)
    if style == "numeric_dollar":
        mark = "${}"
        first = 1
    elif style == "named":
        mark = ":p{}"
        first = 0
    else:
        raise ConfigurationError(f"no statement marks for the paramstyle {style!r}")
    out = [pieces[0]]
    for i, piece in enumerate(pieces[1:]):
        out.append(mark.format(i + first))
        out.append(piece)
    return "".join(out)


#: the top-level package of a connection's class -> the adapter module for it
SYNC_ADAPTERS = {
    "sqlite3": "_sqlite",
    "psycopg": "_pg",
    "sqlalchemy": "_sqlalchemy_writer",
    "django": "_django_writer",
    "pymysql": "_mysql",
}
ASYNC_ADAPTERS = {
    "psycopg": "_pg",
    "sqlalchemy": "_sqlalchemy_writer",
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
