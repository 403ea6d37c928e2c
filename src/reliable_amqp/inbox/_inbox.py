"""Inbox and AsyncInbox: each message's effects exactly once, in the handler's own transaction.

``claim()`` inserts ``(scope, message_id)`` on the caller's connection, inside the caller's open
transaction, and never commits: the claim exists if and only if the handler's work commits with
it. The primary key does the rest: a second claim of a committed key changes no row (a
duplicate), and a claim of a key that another transaction holds uncommitted waits for that
transaction, then answers as it ended. Statements go through the outbox's connection adapters
(:mod:`reliable_amqp.outbox._adapters`): the same connections, the same checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from reliable_amqp._core.errors import ConfigurationError, MissingMessageId
from reliable_amqp.inbox import _collation, _prune, _schema
from reliable_amqp.inbox._handler import async_handler, sync_handler
from reliable_amqp.inbox._prune import async_prune_batch, pause, prune_batch, take_turns
from reliable_amqp.inbox._schema import (
    DEFAULT_RETENTION,
    DEFAULT_TABLE,
    MAX_KEY,
    PRUNE_BATCH,
    PRUNE_FLOOR,
    InboxTables,
)
from reliable_amqp.inbox._telemetry import InboxMetrics
from reliable_amqp.outbox._adapters import async_writer, sync_writer

#: the header that carries the consumer's attempt number (1 the first time)
ATTEMPT_HEADER = "x-consume-attempt"


class DeliveryLike(Protocol):
    """What the inbox reads of a delivery (``reliable_amqp.Delivery`` has it all)."""

    @property
    def message_id(self) -> str | None: ...
    @property
    def redelivered(self) -> bool: ...
    @property
    def headers(self) -> Mapping[str, Any]: ...


@dataclass
class InboxStats:
    """Counts of this process's inbox: new claims, duplicates skipped, rows pruned, and
    redeliveries written to the attempts ledger."""

    claimed: int = 0
    duplicates: int = 0
    pruned: int = 0
    redeliveries_recorded: int = 0


def copy_attempt(delivery: Any) -> int:
    """The attempt number of the copy delivered: the ``x-consume-attempt`` header a retried
    copy carries, else 1. The ledger counts the broker's redeliveries of that copy on top."""
    headers = getattr(delivery, "headers", None) or {}
    attempt = headers.get(ATTEMPT_HEADER, 1)
    return attempt if type(attempt) is int and attempt >= 1 else 1


def _reported(delivery: Any, base: int) -> int:
    """The delivery's own attempt number (``reliable_amqp.Delivery.attempt``: the header, plus
    one when redelivered, or the header plus a quorum queue's ``x-delivery-count``)."""
    attempt = getattr(delivery, "attempt", None)
    return attempt if type(attempt) is int and attempt >= 1 else base


class _Base:
    def __init__(
        self, scope: str, table: str = DEFAULT_TABLE, *, meter_provider: Any = None
    ) -> None:
        if not isinstance(scope, str) or not scope or len(scope) > MAX_KEY:
            raise ConfigurationError(
                f"scope: expected a non-empty str of at most {MAX_KEY} characters (the name of "
                f"the consuming service or handler), got {scope!r}"
            )
        self.scope = scope
        self.tables = InboxTables.named(table)
        self.stats = InboxStats()
        self._lock = threading.Lock()
        #: OpenTelemetry counters (the global meter provider's unless one is given)
        self.metrics = InboxMetrics(self.tables.name, scope, meter_provider)

    @property
    def table(self) -> str:
        """The claims table's name (the attempts ledger is ``<table>_attempts``)."""
        return self.tables.name

    def ddl(self, dialect: str = "postgresql") -> str:
        """The statements ``install()`` runs (``postgresql``, ``sqlite`` or ``mysql``), for
        migration tools."""
        return ";\n\n".join(_schema.ddl(dialect, self.tables)) + ";\n"

    def key_of(self, delivery: Any, key: str | None = None) -> str:
        """The claim's key: ``key`` when given, else the delivery's ``message_id``; raises
        :class:`MissingMessageId` when there is neither."""
        if key is None:
            key = getattr(delivery, "message_id", None)
            if key is None or key == "":
                raise MissingMessageId(
                    "this delivery has no message_id, so its duplicates cannot be recognised: "
                    "pass key= (a value derived from the message that is the same on every "
                    "copy, such as a business id from its body)"
                )
        if not isinstance(key, str) or not key or len(key) > MAX_KEY:
            raise ConfigurationError(
                f"key: expected a non-empty str of at most {MAX_KEY} characters, got {key!r}"
            )
        return key

    def _counted(self, claimed: bool) -> bool:
        with self._lock:
            if claimed:
                self.stats.claimed += 1
            else:
                self.stats.duplicates += 1
        self.metrics.add(self.metrics.claims if claimed else self.metrics.duplicates)
        return claimed

    def _recorded(self) -> None:
        with self._lock:
            self.stats.redeliveries_recorded += 1
        self.metrics.add(self.metrics.redeliveries)

    def _pruned(self, count: int) -> None:
        with self._lock:
            self.stats.pruned += count
        self.metrics.add(self.metrics.pruned, count)

    def _prune_plan(
        self, dialect: str, older_than: float, batch: int, scopes: Sequence[Sequence[str]]
    ) -> list[tuple[_schema.PruneStep, str, float]]:
        """(step, scope, cutoff) for each table and each of its ``scopes`` (claims, ledger)."""
        cutoff = time.time() - float(older_than)
        return [
            (_schema.prune_step(dialect, table, column), scope, cutoff)
            for (table, column), names in zip(self._pruned_tables(), scopes, strict=True)
            for scope in names
        ]

    def _pruned_tables(self) -> tuple[tuple[str, str], ...]:
        return ((self.tables.name, "claimed_at"), (self.tables.attempts, "last_at"))

    def _scopes_sql(self, dialect: str) -> list[str]:
        return [_schema.scopes_sql(dialect, table) for table, _ in self._pruned_tables()]

    def _mine(self) -> list[list[str]]:
        return [[self.scope] for _ in self._pruned_tables()]

    def _listed(self, listed: list[list[tuple[Any, ...]]]) -> list[list[str]]:
        return [[_collation.as_text(row[0]) for row in rows] for rows in listed]

    def _warn(self, older_than: float, all_scopes: bool) -> None:
        _prune.warn_below_floor(self.tables.name, None if all_scopes else self.scope, older_than)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.scope!r} {self.tables.name!r}>"


def _check_prune(older_than: float, batch: int) -> None:
    if not isinstance(older_than, (int, float)) or older_than < 0:
        raise ConfigurationError(f"older_than: expected seconds >= 0, got {older_than!r}")
    if not isinstance(batch, int) or batch < 1:
        raise ConfigurationError(f"batch: expected a positive int, got {batch!r}")


@functools.lru_cache(maxsize=64)
def _claim_sql(dialect: str, tables: InboxTables) -> str:
    return _schema.claim_sql(_known(dialect), tables)


def _known(dialect: str) -> str:
    if dialect not in _schema.DIALECTS:
        raise ConfigurationError(
            f"the inbox runs on PostgreSQL, SQLite, MariaDB and MySQL; got a {dialect!r} database"
        )
    return dialect


def _is_factory(conn: Any, writer_of: Callable[[Any], object]) -> bool:
    """Whether ``conn`` opens connections rather than being one (a ``sqlite3.Connection`` is
    callable too)."""
    try:
        writer_of(conn)
    except ConfigurationError:
        if callable(conn):
            return True
        raise
    return False


def _closing(conn: Any) -> Any:
    close = getattr(conn, "close", None)
    return close() if close is not None else None


class Inbox(_Base):
    """Claims messages in the caller's transaction, on the connection the caller holds: a
    psycopg 3 ``Connection``, a ``sqlite3.Connection``, a SQLAlchemy ``Session`` or
    ``Connection``, Django's ``connection`` (in ``transaction.atomic()``) or a PyMySQL
    connection.

    ``Inbox(scope, table="amqp_inbox")``: ``scope`` names the consuming service or handler, so
    that two services that consume the same message each handle it once.
    """

    def install(self, conn: Any) -> None:
        """Create the inbox's tables if missing (idempotent); the caller commits (DDL commits
        on its own on MariaDB and MySQL). On those, an existing table whose keys ignore
        trailing spaces (PAD SPACE, as this library made them before) is left as it is, with
        a WARNING naming its columns and the ALTER that migrates them."""
        writer = sync_writer(conn)
        dialect = writer.dialect(conn)
        for statement in _schema.ddl(dialect, self.tables):
            writer.run(conn, statement)
        if dialect == "mysql":  # a table made before may ignore trailing spaces
            _collation.check(writer, conn, self.tables)

    def claim(self, conn: Any, delivery: Any, *, key: str | None = None) -> bool:
        """Claim ``delivery`` in the caller's open transaction: True the first time (handle it),
        False when a committed transaction claimed it already (skip it; ack it).

        When another transaction holds the same claim uncommitted, this waits for it to end and
        answers as it ended (True if it rolled back). ``key`` replaces the message id as the
        claim's key; a delivery with no ``message_id`` and no ``key`` raises
        :class:`MissingMessageId`. Never commits; raises
        :class:`~reliable_amqp.ConfigurationError` for a connection on which the claim would
        commit on its own (autocommit with no transaction open).
        """
        claim_key = self.key_of(delivery, key)
        writer = sync_writer(conn)
        sql = _claim_sql(writer.dialect(conn), self.tables)
        changed = writer.run(conn, sql, (self.scope, claim_key, time.time()), "claim()")
        return self._counted(changed == 1)

    def prune(
        self,
        conn: Any,
        older_than: float = DEFAULT_RETENTION,
        *,
        batch: int = PRUNE_BATCH,
        all_scopes: bool = False,
    ) -> int:
        """Delete this scope's claims (and attempts-ledger rows) older than ``older_than``
        seconds, at most ``batch`` rows per statement; how many claims and ledger rows went.

        On a connection with no transaction open, each batch runs in a transaction of its own,
        committed before the next (prune owns those transactions: other writers wait for one
        short batch at most). Inside the caller's open transaction, the batches run in it and
        the caller commits. ``all_scopes=True`` prunes every scope's rows. Below
        ``MIN_RETENTION`` (a day) it logs a WARNING, then prunes as asked: claims of messages
        that can still come again go, and such a copy is handled a second time.
        """
        _check_prune(older_than, batch)
        writer = sync_writer(conn)
        dialect = _known(writer.dialect(conn))
        self._warn(older_than, all_scopes)
        owned = not writer.in_transaction(conn)
        scopes = self._mine()
        if all_scopes:  # a plain read of which scopes have rows, in a transaction that ends
            with writer.transaction(conn) if owned else contextlib.nullcontext():
                scopes = self._listed([writer.fetch(conn, q) for q in self._scopes_sql(dialect)])
        plan = self._prune_plan(dialect, older_than, batch, scopes)
        # a sqlite3 connection polls for the write lock itself (see _prune.take_turns)
        polling = owned and isinstance(conn, sqlite3.Connection)
        saved = conn.execute("PRAGMA busy_timeout").fetchone()[0] if polling else 0
        if polling:
            conn.execute("PRAGMA busy_timeout = 0")
        total = 0
        try:
            for step, scope, cutoff in plan:
                low = PRUNE_FLOOR
                while True:
                    began = time.monotonic()
                    params = (scope, low, cutoff, batch)
                    if polling:
                        found, deleted, newest = take_turns(writer, conn, step, params, saved)
                    elif owned:
                        with writer.transaction(conn):
                            found, deleted, newest = prune_batch(writer, conn, step, params)
                    else:
                        found, deleted, newest = prune_batch(writer, conn, step, params)
                    low = low if newest is None else newest
                    total += deleted
                    self._pruned(deleted)
                    if found < batch:
                        break
                    if owned and dialect == "sqlite":
                        time.sleep(pause(began))
        finally:
            if polling:
                conn.execute(f"PRAGMA busy_timeout = {int(saved)}")
        return total

    def record_attempt(self, conn: Any, delivery: Any, *, key: str | None = None) -> int:
        """This delivery's attempt number, counting the crashes the broker's redeliveries
        reveal: call it before the handler runs, and dead-letter the message past
        ``max_attempts``. The ledger counts the redeliveries of the copy delivered (its
        ``x-consume-attempt`` header, 1 for the original), this one included; this returns that
        copy's number plus the count, or ``delivery.attempt`` when that says more (a quorum
        queue's ``x-delivery-count``).

        A first delivery (``redelivered`` false) costs nothing: no statement runs. A redelivered
        one is counted durably in the attempts ledger in a short transaction of its own,
        committed before this returns, so the count survives the handler's transaction
        rolling back and the process dying. ``conn`` must therefore not be the handler's
        connection: pass a connection with no transaction open, or a callable that opens a
        new connection (closed after use).
        """
        base = copy_attempt(delivery)
        reported = _reported(delivery, base)
        if not getattr(delivery, "redelivered", False):
            return reported
        claim_key = self.key_of(delivery, key)
        if _is_factory(conn, sync_writer):
            opened = conn()
            try:
                redeliveries = self._record(opened, claim_key, base)
            finally:
                _closing(opened)
        else:
            redeliveries = self._record(conn, claim_key, base)
        return max(reported, base + redeliveries)

    def _record(self, conn: Any, claim_key: str, attempt: int) -> int:
        """Count one redelivery of (scope, key, copy attempt); the redeliveries counted."""
        writer = sync_writer(conn)
        dialect = _known(writer.dialect(conn))
        if writer.in_transaction(conn):
            raise _ledger_in_transaction()
        key = (self.scope, claim_key, attempt)
        with writer.transaction(conn):
            writer.run(conn, _schema.attempt_upsert_sql(dialect, self.tables), (*key, time.time()))
            rows = writer.fetch(conn, _schema.attempt_select_sql(dialect, self.tables), key)
        self._recorded()
        return int(rows[0][0])

    def forget_attempts(self, conn: Any, delivery: Any, *, key: str | None = None) -> int:
        """Delete the ledger rows of ``delivery``'s message, in the caller's transaction (the
        handler's, once it handled the message: they are not needed any more). How many."""
        writer = sync_writer(conn)
        dialect = _known(writer.dialect(conn))
        params = (self.scope, self.key_of(delivery, key))
        return writer.run(conn, _schema.attempt_delete_sql(dialect, self.tables), params)

    def handler(
        self,
        connect: Callable[[], Any],
        handle: Callable[[Any, Any], object],
        *,
        key: Callable[[Any], str] | None = None,
    ) -> Callable[[Any], None]:
        """A ``handler(delivery)`` for ``Consumer.run``: on a connection from ``connect()``, it
        opens a transaction, claims the delivery, calls ``handle(delivery, conn)`` when the claim
        is new, and commits; the consumer acks once it returned. When ``handle`` raises, the
        transaction (the claim with it) rolls back and the exception goes on to the consumer.
        ``key(delivery)``, when given, derives the claim's key. What ``connect`` may return:
        docs/inbox.md."""
        return sync_handler(self, connect, handle, key)


class AsyncInbox(_Base):
    """:class:`Inbox` for asyncio connections (psycopg 3's ``AsyncConnection``, SQLAlchemy's
    ``AsyncSession`` and ``AsyncConnection``, asyncpg): the same methods, awaited."""

    async def install(self, conn: Any) -> None:
        """:meth:`Inbox.install`, awaited."""
        writer = async_writer(conn)
        dialect = writer.dialect(conn)
        for statement in _schema.ddl(dialect, self.tables):
            await writer.run(conn, statement)
        if dialect == "mysql":
            await _collation.async_check(writer, conn, self.tables)

    async def claim(self, conn: Any, delivery: Any, *, key: str | None = None) -> bool:
        """:meth:`Inbox.claim`, awaited."""
        claim_key = self.key_of(delivery, key)
        writer = async_writer(conn)
        sql = _claim_sql(writer.dialect(conn), self.tables)
        changed = await writer.run(conn, sql, (self.scope, claim_key, time.time()), "claim()")
        return self._counted(changed == 1)

    async def prune(
        self,
        conn: Any,
        older_than: float = DEFAULT_RETENTION,
        *,
        batch: int = PRUNE_BATCH,
        all_scopes: bool = False,
    ) -> int:
        """:meth:`Inbox.prune`, awaited."""
        _check_prune(older_than, batch)
        writer = async_writer(conn)
        dialect = _known(writer.dialect(conn))
        self._warn(older_than, all_scopes)
        owned = not writer.in_transaction(conn)
        scopes = self._mine()
        if all_scopes:
            async with writer.transaction(conn) if owned else contextlib.nullcontext():
                listed = [await writer.fetch(conn, sql) for sql in self._scopes_sql(dialect)]
            scopes = self._listed(listed)
        total = 0
        for step, scope, cutoff in self._prune_plan(dialect, older_than, batch, scopes):
            low = PRUNE_FLOOR
            while True:
                began = time.monotonic()
                params = (scope, low, cutoff, batch)
                if owned:
                    async with writer.transaction(conn):
                        found, deleted, newest = await async_prune_batch(writer, conn, step, params)
                else:
                    found, deleted, newest = await async_prune_batch(writer, conn, step, params)
                low = low if newest is None else newest
                total += deleted
                self._pruned(deleted)
                if found < batch:
                    break
                if owned and dialect == "sqlite":
                    await asyncio.sleep(pause(began))
        return total

    async def record_attempt(self, conn: Any, delivery: Any, *, key: str | None = None) -> int:
        """:meth:`Inbox.record_attempt`, awaited (``conn`` may be a callable returning a
        connection or an awaitable of one)."""
        base = copy_attempt(delivery)
        reported = _reported(delivery, base)
        if not getattr(delivery, "redelivered", False):
            return reported
        claim_key = self.key_of(delivery, key)
        if _is_factory(conn, async_writer):
            opened = conn()
            if inspect.isawaitable(opened):
                opened = await opened
            try:
                redeliveries = await self._record(opened, claim_key, base)
            finally:
                closed = _closing(opened)
                if inspect.isawaitable(closed):
                    await closed
        else:
            redeliveries = await self._record(conn, claim_key, base)
        return max(reported, base + redeliveries)

    async def _record(self, conn: Any, claim_key: str, attempt: int) -> int:
        writer = async_writer(conn)
        dialect = _known(writer.dialect(conn))
        if writer.in_transaction(conn):
            raise _ledger_in_transaction()
        key = (self.scope, claim_key, attempt)
        async with writer.transaction(conn):
            upsert = _schema.attempt_upsert_sql(dialect, self.tables)
            await writer.run(conn, upsert, (*key, time.time()))
            rows = await writer.fetch(conn, _schema.attempt_select_sql(dialect, self.tables), key)
        self._recorded()
        return int(rows[0][0])

    async def forget_attempts(self, conn: Any, delivery: Any, *, key: str | None = None) -> int:
        """:meth:`Inbox.forget_attempts`, awaited."""
        writer = async_writer(conn)
        dialect = _known(writer.dialect(conn))
        params = (self.scope, self.key_of(delivery, key))
        return await writer.run(conn, _schema.attempt_delete_sql(dialect, self.tables), params)

    def handler(
        self,
        connect: Callable[[], Any],
        handle: Callable[[Any, Any], Any],
        *,
        key: Callable[[Any], str] | None = None,
    ) -> Callable[[Any], Any]:
        """An ``async handler(delivery)`` for ``AsyncConsumer.run``: :meth:`Inbox.handler`,
        awaited."""
        return async_handler(self, connect, handle, key)


def _ledger_in_transaction() -> ConfigurationError:
    return ConfigurationError(
        "record_attempt(): this connection has a transaction open; the attempts ledger is "
        "written in a transaction of its own (the handler's rolls back when it crashes, and "
        "the count would go with it): pass another connection, or a callable that opens one"
    )
