"""Outbox and AsyncOutbox: write messages as rows in the caller's own transaction.

``add()`` runs on the connection the caller holds, inside the caller's open transaction, and
never commits: the message exists if and only if that transaction commits. It checks the
message as ``publish()`` does, so a message AMQP cannot carry raises
:class:`~reliable_amqp.InvalidMessage` before anything is written. Each kind of connection is
one small adapter (see :mod:`._adapters`) that only moves rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._adapters import async_writer, sync_writer
from reliable_amqp.outbox._rows import RowValues, many_row_values, row_values
from reliable_amqp.outbox._schema import (
    DEFAULT_TABLE,
    Tables,
    mysql_ddl,
    postgresql_ddl,
    sqlite_ddl,
)
from reliable_amqp.outbox._telemetry import current_trace

#: the DDL of each dialect ``ddl()`` prints (adapters of other databases add theirs)
DDL: dict[str, Callable[[Tables], list[str]]] = {
    "postgresql": postgresql_ddl,
    "sqlite": sqlite_ddl,
    "mysql": mysql_ddl,
}


class _Base:
    def __init__(self, table: str = DEFAULT_TABLE, *, notify: bool = True) -> None:
        self.tables = Tables.named(table)
        #: wake idle relays at commit (PostgreSQL: NOTIFY; SQLite: this process's relays); see
        #: docs/outbox.md for what it costs the writers' commits
        self.notify = bool(notify)

    @property
    def table(self) -> str:
        """The outbox table's name."""
        return self.tables.name

    def ddl(self, dialect: str = "postgresql") -> str:
        """The statements ``install()`` runs, for migration tools (``postgresql``, ``sqlite``,
        ...)."""
        make = DDL.get(dialect)
        if make is None:
            raise ConfigurationError(
                f"dialect: expected one of {', '.join(sorted(DDL))}, got {dialect!r}"
            )
        return ";\n\n".join(make(self.tables)) + ";\n"

    def _row(  # noqa: PLR0917  (add()'s arguments, passed on)
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        key: str | None,
        message_id: str | None,
        mandatory: bool | None,
        properties: Mapping[str, Any],
    ) -> RowValues:
        return row_values(
            exchange,
            routing_key,
            body,
            key=key,
            message_id=message_id,
            mandatory=mandatory,
            properties=properties,
            trace=current_trace(),
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.tables.name!r}>"


class Outbox(_Base):
    """Writes messages into the outbox table in the caller's transaction, on the connection the
    caller holds: a psycopg 3 ``Connection``, a ``sqlite3.Connection``, a SQLAlchemy
    ``Session`` or ``Connection``, Django's ``connection`` (in ``transaction.atomic()``) or a
    PyMySQL connection; a relay (:class:`OutboxRelay`) publishes them once committed.

    ``Outbox(table="amqp_outbox", notify=True)``.
    """

    def install(self, conn: Any) -> None:
        """Create the outbox's tables if missing (idempotent); the caller commits."""
        sync_writer(conn).install(conn, self.tables)

    def add(
        self,
        conn: Any,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        key: str | None = None,
        message_id: str | None = None,
        mandatory: bool | None = None,
        **properties: Any,
    ) -> str:
        """Write one message in the caller's open transaction; returns its ``message_id``.

        ``key`` orders messages: those with the same key reach the broker in the order their
        transactions committed. ``message_id`` defaults to a fresh id; every copy the relay
        publishes carries it. ``mandatory`` defaults to True (a message no queue takes fails
        instead of vanishing). Keyword properties are AMQP basic properties, as for
        ``publish()``. Never commits, never opens a connection; raises
        :class:`~reliable_amqp.InvalidMessage` for a message AMQP cannot carry and
        :class:`~reliable_amqp.ConfigurationError` for a connection that would commit the row
        on its own (autocommit outside a transaction).
        """
        row = self._row(exchange, routing_key, body, key, message_id, mandatory, properties)
        self._write(conn, [row])
        return row[0]

    def add_many(self, conn: Any, messages: Iterable[Mapping[str, Any]]) -> list[str]:
        """Write several messages in the caller's open transaction, in order; their ids.

        Each item is a mapping with ``exchange``, ``routing_key``, ``body`` and optionally
        ``key``, ``message_id``, ``mandatory`` and ``properties`` (a dict of AMQP properties).
        All are checked before any is written (:class:`~reliable_amqp.InvalidMessage` names
        ``messages[i]``).
        """
        rows = many_row_values(messages, current_trace())
        if rows:
            self._write(conn, rows)
        return [row[0] for row in rows]

    def _write(self, conn: Any, rows: list[RowValues]) -> None:
        sync_writer(conn).write(conn, self.tables, rows, self.notify)


class AsyncOutbox(_Base):
    """:class:`Outbox` for asyncio connections (psycopg 3's ``AsyncConnection``, ...): the same
    methods, awaited."""

    async def install(self, conn: Any) -> None:
        """Create the outbox's tables if missing (idempotent); the caller commits."""
        await async_writer(conn).install(conn, self.tables)

    async def add(
        self,
        conn: Any,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        key: str | None = None,
        message_id: str | None = None,
        mandatory: bool | None = None,
        **properties: Any,
    ) -> str:
        """:meth:`Outbox.add`, awaited."""
        row = self._row(exchange, routing_key, body, key, message_id, mandatory, properties)
        await async_writer(conn).write(conn, self.tables, [row], self.notify)
        return row[0]

    async def add_many(self, conn: Any, messages: Iterable[Mapping[str, Any]]) -> list[str]:
        """:meth:`Outbox.add_many`, awaited."""
        rows = many_row_values(messages, current_trace())
        writer = async_writer(conn)
        if rows:
            await writer.write(conn, self.tables, rows, self.notify)
        return [row[0] for row in rows]
