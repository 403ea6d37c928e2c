"""Operator tools on an inbox by DSN (what ``reliable-amqp inbox`` runs): create its tables,
look at it, prune it. Each opens a connection of its own (the outbox tools' connections)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp.inbox import _schema
from reliable_amqp.inbox._collation import pad_space_columns
from reliable_amqp.inbox._inbox import Inbox
from reliable_amqp.inbox._schema import DEFAULT_RETENTION, DEFAULT_TABLE, PRUNE_BATCH, InboxTables
from reliable_amqp.outbox._adapters import sync_writer
from reliable_amqp.outbox._tools import connect


@dataclass(frozen=True)
class InboxStatus:
    """The inbox at a glance: ``rows`` claims kept, ``oldest_age_s`` the age in seconds of the
    oldest (None when empty), ``attempts`` rows in the attempts ledger (redelivered messages not
    yet handled), ``pad_space_columns`` the key columns (``table.column``) that ignore trailing
    spaces (MariaDB and MySQL tables made before the keys became varbinary: migrate them, see
    docs/inbox.md; always empty on PostgreSQL and SQLite)."""

    rows: int
    oldest_age_s: float | None
    attempts: int
    pad_space_columns: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``inbox status --json``)."""
        return asdict(self)


def _raw(dialect: str, conn: Any) -> Any:
    return conn.raw if dialect == "mysql" else conn


def _check_tables(dialect: str, raw: Any, tables: InboxTables) -> None:
    """Raise :class:`~reliable_amqp.ConfigurationError` unless the inbox's claims table exists
    (rather than the driver's "no such table", which reads like a database gone away)."""
    schema, _, name = tables.name.rpartition(".")
    params: tuple[str, ...]
    if dialect == "postgresql":
        sql, params = "SELECT to_regclass(%s) IS NOT NULL", (tables.name,)
    elif dialect == "mysql":
        where = "%s" if schema else "DATABASE()"
        sql = (
            "SELECT count(*) FROM information_schema.tables"
            f" WHERE table_schema = {where} AND table_name = %s"
        )
        params = (schema, name) if schema else (name,)
    else:
        master = f"{schema}.sqlite_master" if schema else "sqlite_master"
        sql, params = f"SELECT count(*) FROM {master} WHERE type = 'table' AND name = %s", (name,)
    if not sync_writer(raw).fetch(raw, sql, params)[0][0]:
        raise ConfigurationError(
            f"no inbox table {tables.name} in this database: create it with "
            "`reliable-amqp inbox init --db DSN` or Inbox(scope).install(conn)"
        )


def _padded(dialect: str, raw: Any, tables: InboxTables) -> tuple[str, ...]:
    if dialect != "mysql":
        return ()
    return pad_space_columns(sync_writer(raw), raw, tables)


def install(db: str, table: str = DEFAULT_TABLE) -> tuple[str, ...]:
    """Create the inbox's tables if missing (``inbox init``); the key columns of an existing
    table that ignore trailing spaces (see :class:`InboxStatus`), () when none."""
    inbox = Inbox("-", table)
    with connect(db) as (dialect, conn):
        inbox.install(_raw(dialect, conn))
        return _padded(dialect, _raw(dialect, conn), inbox.tables)


def status(db: str, table: str = DEFAULT_TABLE) -> InboxStatus:
    """How many claims the inbox keeps, the oldest one's age, and the ledger's size."""
    tables = InboxTables.named(table)
    with connect(db) as (dialect, conn):
        raw = _raw(dialect, conn)
        _check_tables(dialect, raw, tables)
        writer = sync_writer(raw)
        claims, ledger = _schema.status_sql(dialect, tables)
        rows, oldest = writer.fetch(raw, claims)[0]
        (attempts,) = writer.fetch(raw, ledger)[0]
        padded = _padded(dialect, raw, tables)
    return InboxStatus(
        rows=int(rows),
        oldest_age_s=None if oldest is None else max(0.0, time.time() - float(oldest)),
        attempts=int(attempts),
        pad_space_columns=padded,
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
    all), one committed batch at a time; how many. Below ``MIN_RETENTION`` (a day) it logs a
    WARNING, as :meth:`Inbox.prune` does."""
    inbox = Inbox(scope or "-", table)
    with connect(db) as (dialect, conn):
        _check_tables(dialect, _raw(dialect, conn), inbox.tables)
        return inbox.prune(_raw(dialect, conn), older_than, batch=batch, all_scopes=scope is None)


def observe(db: str, table: str = DEFAULT_TABLE, *, meter_provider: Any = None) -> bool:
    """Report the inbox's size to OpenTelemetry: observable gauges
    ``reliable_amqp.inbox.rows`` (claims kept), ``reliable_amqp.inbox.attempts`` (the attempts
    ledger's rows) and ``reliable_amqp.inbox.oldest_age`` (seconds), read with :func:`status`
    on a connection of their own each time the SDK collects (its export interval, not per
    message). True when registered; False without an SDK (nothing is made then).
    """
    try:
        from opentelemetry import metrics
    except ImportError:  # the otel extra is not installed
        return False
    from reliable_amqp._otel import _is_proxy_or_noop

    provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
    if _is_proxy_or_noop(provider, metrics):
        return False
    InboxTables.named(table)  # a bad name is refused now, not at every collection
    attributes = {"reliable_amqp.inbox.table": table}
    last: dict[str, InboxStatus] = {}

    def read(_options: Any) -> InboxStatus:
        # one query for the three gauges of a collection (they are called in turn)
        found = status(db, table)
        last["status"] = found
        return found

    def rows(options: Any) -> list[Any]:
        return [metrics.Observation(read(options).rows, attributes)]

    def attempts(_options: Any) -> list[Any]:
        found = last.get("status")
        return [] if found is None else [metrics.Observation(found.attempts, attributes)]

    def oldest(_options: Any) -> list[Any]:
        found = last.get("status")
        if found is None or found.oldest_age_s is None:
            return []
        return [metrics.Observation(found.oldest_age_s, attributes)]

    meter = provider.get_meter("reliable_amqp.inbox")
    meter.create_observable_gauge(
        "reliable_amqp.inbox.rows", [rows], unit="{row}", description="Claims kept"
    )
    meter.create_observable_gauge(
        "reliable_amqp.inbox.attempts",
        [attempts],
        unit="{row}",
        description="Rows of the attempts ledger (redelivered messages not yet handled)",
    )
    meter.create_observable_gauge(
        "reliable_amqp.inbox.oldest_age", [oldest], unit="s", description="The oldest claim's age"
    )
    return True
