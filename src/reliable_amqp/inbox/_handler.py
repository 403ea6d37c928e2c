"""The transactional handler: ``handler(delivery)`` callables for ``Consumer.run`` and
``AsyncConsumer.run`` that open a transaction, claim, call ``handle(delivery, conn)`` when the
claim is new, and commit; the consumer acks once the callable returned. On an exception the
transaction rolls back (the claim with the work) and the exception goes on to the consumer,
which tries the message again later.

``connect()`` gives the connection of one message:

- a context manager that yields a connection (closed or given back at its end): a psycopg
  ``Connection`` from ``psycopg.connect``, a SQLAlchemy ``Session`` from a ``sessionmaker``, a
  ``Connection`` from ``engine.connect``, a PyMySQL connection; asyncio: ``pool.acquire()`` of
  asyncpg, ``engine.connect()``, an ``async_sessionmaker()``'s ``AsyncSession``;
- an awaitable of a connection (``asyncpg.connect(...)``, ``AsyncConnection.connect(...)``):
  the connection is closed after the message;
- a connection as it is (Django's ``connection``, or one long-lived connection of the caller's),
  used and left open.

The connection must have no transaction open: the handler's transaction is the one committed
before the ack.
"""

from __future__ import annotations

import functools
import inspect
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.outbox._adapters import async_writer, sync_writer


class Claims(Protocol):
    """What the handler needs of an :class:`~reliable_amqp.inbox.Inbox`."""

    def key_of(self, delivery: Any, key: str | None = None) -> str: ...
    def claim(self, conn: Any, delivery: Any, *, key: str | None = None) -> bool: ...
    def forget_attempts(self, conn: Any, delivery: Any, *, key: str | None = None) -> int: ...


class AsyncClaims(Protocol):
    """What the handler needs of an :class:`~reliable_amqp.inbox.AsyncInbox`."""

    def key_of(self, delivery: Any, key: str | None = None) -> str: ...
    def claim(self, conn: Any, delivery: Any, *, key: str | None = None) -> Awaitable[bool]: ...
    def forget_attempts(
        self, conn: Any, delivery: Any, *, key: str | None = None
    ) -> Awaitable[int]: ...


def _busy(what: str) -> ConfigurationError:
    return ConfigurationError(
        f"{what}: the connection connect() gave has a transaction open already; the handler's "
        "transaction must be the one committed before the ack (a nested block would only be a "
        "savepoint): give a connection with no transaction open"
    )


def sync_handler(
    inbox: Claims,
    connect: Callable[[], Any],
    handle: Callable[[Any, Any], object],
    key: Callable[[Any], str] | None,
) -> Callable[[Any], None]:
    """See :meth:`Inbox.handler`."""
    if not callable(connect) or not callable(handle):
        raise ConfigurationError("handler(connect, handle): both must be callables")

    def run(conn: Any, delivery: Any, claim_key: str | None) -> None:
        writer = sync_writer(conn)
        if writer.in_transaction(conn):
            raise _busy("Inbox.handler")
        with writer.transaction(conn):
            if inbox.claim(conn, delivery, key=claim_key):
                handle(delivery, conn)
            if getattr(delivery, "redelivered", False):
                # handled (or a duplicate): its crash count is not needed any more
                inbox.forget_attempts(conn, delivery, key=claim_key)

    @functools.wraps(handle)
    def handler(delivery: Any) -> None:
        claim_key = key(delivery) if key is not None else None
        inbox.key_of(delivery, claim_key)  # refuse a delivery without an id before connecting
        opened = connect()
        if hasattr(opened, "__enter__") and not _is_bare_connection(opened):
            with opened as conn:
                run(conn, delivery, claim_key)
        else:
            run(opened, delivery, claim_key)

    return handler


def _is_bare_connection(obj: Any) -> bool:
    """A ``sqlite3.Connection`` is a context manager that commits, not one that yields a
    connection and closes it: treat it as a connection (left open)."""
    return isinstance(obj, sqlite3.Connection)


def async_handler(
    inbox: AsyncClaims,
    connect: Callable[[], Any],
    handle: Callable[[Any, Any], Any],
    key: Callable[[Any], str] | None,
) -> Callable[[Any], Any]:
    """See :meth:`AsyncInbox.handler`."""
    if not callable(connect) or not callable(handle):
        raise ConfigurationError("handler(connect, handle): both must be callables")

    async def run(conn: Any, delivery: Any, claim_key: str | None) -> None:
        writer = async_writer(conn)
        if writer.in_transaction(conn):
            raise _busy("AsyncInbox.handler")
        async with writer.transaction(conn):
            if await inbox.claim(conn, delivery, key=claim_key):
                result = handle(delivery, conn)
                if inspect.isawaitable(result):
                    await result
            if getattr(delivery, "redelivered", False):
                await inbox.forget_attempts(conn, delivery, key=claim_key)

    @functools.wraps(handle)
    async def handler(delivery: Any) -> None:
        claim_key = key(delivery) if key is not None else None
        inbox.key_of(delivery, claim_key)
        opened = connect()
        if hasattr(opened, "__aenter__"):
            async with opened as conn:
                await run(conn, delivery, claim_key)
            return
        if inspect.isawaitable(opened):
            conn = await opened  # ours: closed after this message
            try:
                await run(conn, delivery, claim_key)
            finally:
                closed = conn.close()
                if inspect.isawaitable(closed):
                    await closed
            return
        await run(opened, delivery, claim_key)

    return handler
