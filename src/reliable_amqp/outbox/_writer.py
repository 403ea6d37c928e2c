"""Outbox and AsyncOutbox: write messages as rows in the caller's own transaction.

``add()`` runs on the connection the caller holds, inside the caller's open transaction, and
never commits: the message exists if and only if that transaction commits. It checks the
message as ``publish()`` does, so a message AMQP cannot carry raises
:class:`~reliable_amqp.InvalidMessage` before anything is written. Each kind of connection is
one small adapter (:mod:`._pg`, :mod:`._sqlite`) that only moves rows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox import _pg, _sqlite
from reliable_amqp.outbox._rows import RowValues, many_row_values, row_values
from reliable_amqp.outbox._schema import DEFAULT_TABLE, Tables, postgresql_ddl, sqlite_ddl
from reliable_amqp.outbox._telemetry import current_trace


def _kind(conn: object) -> str:
    if isinstance(conn, sqlite3.Connection):
        return "sqlite"
    module = type(conn).__module__
    if module.startswith("psycopg"):
        if _pg.psycopg is not None and isinstance(conn, _pg.psycopg.AsyncConnection):
            return "psycopg-async"
        if _pg.psycopg is not None and isinstance(conn, _pg.psycopg.Connection):
            return "psycopg"
    raise ConfigurationError(
        f"conn: expected a psycopg 3 Connection or a sqlite3.Connection, got "
        f"{module}.{type(conn).__qualname__}"
    )


class _Base:
    def __init__(self, table: str = DEFAULT_TABLE, *, notify: bool = True) -> None:
        self.tables = Tables.named(table)
        #: PostgreSQL: wake idle relays at commit (LISTEN/NOTIFY); see docs/outbox.md for what
        #: it costs the writers' commits
        self.notify = bool(notify)
        self._sql = _pg.insert_sql(self.tables, self.notify)
        self._sqlite_sql = _sqlite.insert_sql(self.tables)

    @property
    def table(self) -> str:
        """The outbox table's name."""
        return self.tables.name

    def ddl(self, dialect: str = "postgresql") -> str:
        """The statements ``install()`` runs, for migration tools (``postgresql`` or
        ``sqlite``)."""
        if dialect == "postgresql":
            statements = postgresql_ddl(self.tables)
        elif dialect == "sqlite":
            statements = sqlite_ddl(self.tables)
        else:
            raise ConfigurationError(f"dialect: expected 'postgresql' or 'sqlite', got {dialect!r}")
        return ";\n\n".join(statements) + ";\n"

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
    """Writes messages into the outbox table in the caller's transaction (psycopg 3
    ``Connection`` or ``sqlite3.Connection``); a relay (:class:`OutboxRelay`) publishes them
    once committed.

    ``Outbox(table="amqp_outbox", notify=True)``.
    """

    def install(self, conn: Any) -> None:
        """Create the outbox's tables if missing (idempotent); the caller commits."""
        kind = _kind(conn)
        if kind == "psycopg-async":
            raise ConfigurationError("install(): an AsyncConnection goes to AsyncOutbox")
        if kind == "sqlite":
            _sqlite.install(conn, self.tables)
        else:
            _pg.install(conn, self.tables)

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
        kind = _kind(conn)
        if kind == "sqlite":
            _sqlite.check_writable(conn)
            conn.executemany(self._sqlite_sql, rows)
            _sqlite.wake_local()
        elif kind == "psycopg":
            _pg.check_writable(conn)
            if len(rows) == 1:
                conn.execute(self._sql, rows[0], prepare=True)
            else:
                for start in range(0, len(rows), 1000):
                    chunk = rows[start : start + 1000]
                    conn.execute(
                        _pg.insert_many_sql(self.tables, len(chunk), self.notify), _pg.flat(chunk)
                    )
        else:
            raise ConfigurationError("add(): an AsyncConnection goes to AsyncOutbox")


class AsyncOutbox(_Base):
    """:class:`Outbox` for psycopg 3's ``AsyncConnection``: the same methods, awaited."""

    async def install(self, conn: Any) -> None:
        """Create the outbox's tables if missing (idempotent); the caller commits."""
        self._check(conn)
        for statement in postgresql_ddl(self.tables):
            await conn.execute(statement)

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
        self._check(conn)
        _pg.check_writable(conn)
        await conn.execute(self._sql, row, prepare=True)
        return row[0]

    async def add_many(self, conn: Any, messages: Iterable[Mapping[str, Any]]) -> list[str]:
        """:meth:`Outbox.add_many`, awaited."""
        rows = many_row_values(messages, current_trace())
        self._check(conn)
        if rows:
            _pg.check_writable(conn)
            for start in range(0, len(rows), 1000):
                chunk = rows[start : start + 1000]
                await conn.execute(
                    _pg.insert_many_sql(self.tables, len(chunk), self.notify), _pg.flat(chunk)
                )
        return [row[0] for row in rows]

    @staticmethod
    def _check(conn: Any) -> None:
        if _kind(conn) != "psycopg-async":
            raise ConfigurationError(
                "conn: AsyncOutbox takes a psycopg AsyncConnection (use Outbox for "
                f"{type(conn).__module__}.{type(conn).__qualname__})"
            )
