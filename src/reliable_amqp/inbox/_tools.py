"""Operator tools on an inbox by DSN (what ``reliable-amqp inbox`` runs): create its tables,
look at it, prune it. Each opens a connection of its own (the outbox tools' connections)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from reliable_amqp.inbox import _schema
from reliable_amqp.inbox._inbox import Inbox
from reliable_amqp.inbox._schema import DEFAULT_RETENTION, DEFAULT_TABLE, PRUNE_BATCH, InboxTables
from reliable_amqp.outbox._adapters import sync_writer
from reliable_amqp.outbox._tools import connect


@dataclass(frozen=True)
class InboxStatus:
    """The inbox at a glance: ``rows`` claims kept, ``oldest_age_s`` the age in seconds of the
    oldest (None when empty), ``attempts`` rows in the attempts ledger (redelivered messages not
    yet handled)."""

    rows: int
    oldest_age_s: float | None
    attempts: int

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``inbox status --json``)."""
        return asdict(self)


def _raw(dialect: str, conn: Any) -> Any:
    return conn.raw if dialect == "mysql" else conn


def install(db: str, table: str = DEFAULT_TABLE) -> None:
    """Create the inbox's tables if missing (``inbox init``)."""
    inbox = Inbox("-", table)
    with connect(db) as (dialect, conn):
        inbox.install(_raw(dialect, conn))


def status(db: str, table: str = DEFAULT_TABLE) -> InboxStatus:
    """How many claims the inbox keeps, the oldest one's age, and the ledger's size."""
    tables = InboxTables.named(table)
    with connect(db) as (dialect, conn):
        raw = _raw(dialect, conn)
        writer = sync_writer(raw)
        claims, ledger = _schema.status_sql(dialect, tables)
        rows, oldest = writer.fetch(raw, claims)[0]
        (attempts,) = writer.fetch(raw, ledger)[0]
    return InboxStatus(
        rows=int(rows),
        oldest_age_s=None if oldest is None else max(0.0, time.time() - float(oldest)),
        attempts=int(attempts),
    )


def prune(
    db: str,
    table: str = DEFAULT_TABLE,
    older_than: float = DEFAULT_RETENTION,
    *,
    scope: str | None = None,
    batch: int = PRUNE_BATCH,
) -> int:
    """Delete claims and ledger rows older than ``older_than`` seconds (of one scope, or of
    all), one committed batch at a time; how many."""
    inbox = Inbox(scope or "-", table)
    with connect(db) as (dialect, conn):
        return inbox.prune(_raw(dialect, conn), older_than, batch=batch, all_scopes=scope is None)
