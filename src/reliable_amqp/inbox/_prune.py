"""Prune's batches: one bounded delete of old rows (PostgreSQL and SQLite in one statement,
MariaDB and MySQL by key after a plain read, see :class:`~._schema.PruneStep`), and on SQLite,
taking turns with the writers for its one write lock."""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any

from reliable_amqp.inbox._schema import MIN_RETENTION, PruneStep
from reliable_amqp.outbox._adapters import AsyncWriter, SyncWriter

log = logging.getLogger("reliable_amqp.inbox")


def warn_below_floor(table: str, scope: str | None, older_than: float) -> None:
    """A WARNING when ``older_than`` is below :data:`~._schema.MIN_RETENTION`: the claims it
    prunes may belong to messages that can still come again. Prune still runs as asked."""
    if older_than >= MIN_RETENTION:
        return
    which = "every scope" if scope is None else f"scope {scope!r}"
    log.warning(
        "prune(older_than=%g) of inbox %s (%s) is below the floor of %g s (1 day): a message "
        "that comes again after its claim was pruned (a consumer's retry, a redelivery, a "
        "publisher's or the outbox relay's republish after an outage) is not recognised as a "
        "duplicate and is handled a second time. Keep claims for longer than any copy can "
        "take to arrive (default: 7 days); see docs/inbox.md, Retention and pruning",
        older_than,
        table,
        which,
        MIN_RETENTION,
    )


def pause(began: float) -> float:
    """SQLite: how long prune lets go of the database after a batch. One writer at a time, and a
    waiting writer polls: SQLite's busy handler sleeps 1, 2, 5, 10, 15, 20, 25... ms between its
    tries. Without a pause the next batch takes the lock again at once, and a claim waited for
    the whole prune (132 ms for 20 batches, measured). A pause of twice the batch's time holds
    one of the writer's tries, however long the batch: the writer's wait stays within about
    one and a half batches."""
    return min(2 * (time.monotonic() - began), 0.1)


def take_turns(
    writer: SyncWriter,
    conn: sqlite3.Connection,
    step: PruneStep,
    params: tuple[Any, ...],
    timeout_ms: int,
) -> Batch:
    """One batch on a sqlite3 connection, polling for the write lock every millisecond. SQLite's
    busy handler backs off to 100 ms sleeps, so against a writer that claims without pause
    prune waited most of a second a batch (17 s for 20 batches, measured); polling gets a turn
    as soon as the writer commits."""
    deadline = time.monotonic() + max(timeout_ms, 5000) / 1000
    while True:
        try:
            with writer.transaction(conn):
                return prune_batch(writer, conn, step, params)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.001)


def _by_scope(rows: list[tuple[Any, ...]]) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for scope, message_id, _at in rows:
        keys.setdefault(scope, []).append(message_id)
    return keys


#: one batch's outcome: (rows found, rows deleted, the newest column value found, if known)
Batch = tuple[int, int, float | None]


def prune_batch(writer: SyncWriter, conn: Any, step: PruneStep, params: tuple[Any, ...]) -> Batch:
    """One batch (``params``: scope, low, cutoff, limit)."""
    if step.fetch is not None:
        found, newest, deleted = writer.fetch(conn, step.fetch, params)[0]
        return int(found), int(deleted), None if newest is None else float(newest)
    if step.delete is not None:
        deleted = max(writer.run(conn, step.delete, params), 0)
        return deleted, deleted, None
    assert step.select is not None
    rows = writer.fetch(conn, step.select, params)
    deleted = 0
    for scope, ids in _by_scope(rows).items():
        deleted += writer.run(conn, step.delete_keys(len(ids)), (scope, *ids, params[2]))
    return len(rows), deleted, max((float(r[2]) for r in rows), default=None)


async def async_prune_batch(
    writer: AsyncWriter, conn: Any, step: PruneStep, params: tuple[Any, ...]
) -> Batch:
    """:func:`prune_batch`, awaited."""
    if step.fetch is not None:
        found, newest, deleted = (await writer.fetch(conn, step.fetch, params))[0]
        return int(found), int(deleted), None if newest is None else float(newest)
    if step.delete is not None:
        deleted = max(await writer.run(conn, step.delete, params), 0)
        return deleted, deleted, None
    assert step.select is not None
    rows = await writer.fetch(conn, step.select, params)
    deleted = 0
    for scope, ids in _by_scope(rows).items():
        deleted += await writer.run(conn, step.delete_keys(len(ids)), (scope, *ids, params[2]))
    return len(rows), deleted, max((float(r[2]) for r in rows), default=None)
