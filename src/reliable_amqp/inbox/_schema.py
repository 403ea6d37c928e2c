"""The inbox's tables, their DDL and every statement the inbox runs, for each database. Values
only, no I/O.

Two tables:

- ``<table>``: one row per message handled, keyed ``(scope, message_id)``, with the time it was
  claimed (``claimed_at``, seconds since the epoch, the application's clock) and an index on
  ``(scope, claimed_at)`` for pruning: a scope's oldest rows, in order, whatever the planner's
  statistics say (a bare ``claimed_at`` index let PostgreSQL, with statistics from before a
  bulk load, pick a bitmap of both indexes and a sort: 170-250 ms a batch at 300,000 rows).
  A claim is an INSERT that does nothing when the key exists; the primary key makes a second
  transaction that claims the same key wait for the first one to end.
- ``<table>_attempts``: the attempts ledger, one row per redelivered message (and copy of it:
  the consumer's attempt number), written outside the handler's transaction.

Keys compare byte for byte on every database: PostgreSQL's deterministic collations and
SQLite's BINARY collation do so with ``text``; on MariaDB and MySQL the key columns are
``varbinary``, because their ``utf8mb4_bin`` is PAD SPACE (trailing spaces ignored: an inbox
keyed on it took ``'order-1 '`` for a duplicate of ``'order-1'``), and no NO PAD binary
collation of utf8mb4 exists on both (MariaDB: ``utf8mb4_nopad_bin``; MySQL 8:
``utf8mb4_0900_bin``). Tables made before keep their columns until migrated
(:func:`mysql_migration`); :func:`pad_space_sql` finds them.

Statements are written with ``%s`` marks; each connection adapter turns them into its driver's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from reliable_amqp._core.errors import ConfigurationError

DEFAULT_TABLE = "amqp_inbox"

#: Seven days. A duplicate is caught only while the first copy's row is kept, so rows must
#: outlive the longest time a message can spend being republished: a publisher's spool and an
#: outbox both hold messages through a broker outage, and a consumer's retries add their delays.
#: A week covers an outage over a long weekend with margin (NServiceBus keeps 7 days as well;
#: MassTransit's 30 minutes lets late duplicates through).
DEFAULT_RETENTION = 7 * 24 * 3600.0

#: One day: ``prune()`` below it logs a WARNING and ``inbox prune --older-than`` below 1 day
#: prints one. A claim must outlive every copy of its message, and copies keep coming for as
#: long as something republishes: the consumer's retries (the default redelivery policy: 5
#: attempts, about 17 s of delays in all), a redelivery after a crash, a publisher's spool and the
#: outbox relay after a broker or network outage (as long as the outage). No bound exists for
#: the last; a day covers an outage noticed and mended within a working day, and anything
#: shorter is taken for a mistake (``older_than=0`` pruned live claims and duplicated 299 of
#: 300 effects in a probe). The default retention stays 7 days.
MIN_RETENTION = 24 * 3600.0

#: rows a prune statement deletes at most: each batch is a short transaction of its own, so
#: pruning never holds many locks nor runs one long DELETE
PRUNE_BATCH = 1000

#: the longest scope and message id (an AMQP short string is at most 255 bytes)
MAX_KEY = 255

#: the key columns' size on MariaDB and MySQL, in bytes: MAX_KEY characters of UTF-8
MYSQL_KEY_BYTES = 4 * MAX_KEY

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,47}$")

DIALECTS = ("postgresql", "sqlite", "mysql")


@dataclass(frozen=True)
class InboxTables:
    """The names of one inbox: its claims table and its attempts ledger (schema-qualified names
    keep their schema)."""

    name: str
    attempts: str

    @classmethod
    def named(cls, table: str) -> InboxTables:
        """The tables of the inbox ``table`` (``name`` or ``schema.name``); raises
        :class:`~reliable_amqp.ConfigurationError` for a name that is not a plain identifier."""
        if not isinstance(table, str):
            raise ConfigurationError(f"table: expected a str, got {type(table).__name__}")
        parts = table.split(".")
        if len(parts) > 2 or not all(_NAME.match(p) for p in parts):
            raise ConfigurationError(
                f"table: {table!r} is not a plain SQL identifier (letters, digits and _, "
                "at most 48 characters, optionally schema-qualified as schema.name)"
            )
        return cls(name=table, attempts=f"{table}_attempts")

    def bare(self, name: str) -> str:
        """``name`` without its schema (index names are not schema-qualified)."""
        return name.rsplit(".", 1)[-1]

    def schema_prefix(self) -> str:
        return self.name.rsplit(".", 1)[0] + "." if "." in self.name else ""


def quote(dialect: str, name: str) -> str:
    """A table name as the dialect writes it (MariaDB and MySQL: backquotes)."""
    if dialect == "mysql":
        return ".".join(f"`{part}`" for part in name.split("."))
    return name


# --- DDL ----------------------------------------------------------------------------------------


def postgresql_ddl(t: InboxTables) -> list[str]:
    """``install()`` on PostgreSQL: the statements, each idempotent."""
    return [
        f"CREATE TABLE IF NOT EXISTS {t.name} (\n"
        "    scope text NOT NULL,\n"
        "    message_id text NOT NULL,\n"
        "    claimed_at double precision NOT NULL,\n"
        "    PRIMARY KEY (scope, message_id)\n"
        ")",
        f"CREATE INDEX IF NOT EXISTS {t.bare(t.name)}_scope_claimed_at"
        f" ON {t.name} (scope, claimed_at)",
        f"CREATE TABLE IF NOT EXISTS {t.attempts} (\n"
        "    scope text NOT NULL,\n"
        "    message_id text NOT NULL,\n"
        "    attempt integer NOT NULL,\n"
        "    redeliveries integer NOT NULL,\n"
        "    last_at double precision NOT NULL,\n"
        "    PRIMARY KEY (scope, message_id, attempt)\n"
        ")",
        f"CREATE INDEX IF NOT EXISTS {t.bare(t.attempts)}_scope_last_at"
        f" ON {t.attempts} (scope, last_at)",
    ]


def sqlite_ddl(t: InboxTables) -> list[str]:
    """``install()`` on SQLite: the statements, each idempotent. WITHOUT ROWID: the primary key
    is the table, so a claim writes two b-trees (the table, the pruning index), not three;
    every page a commit writes counts on SQLite (claims 1.6 times as fast, measured)."""
    prefix = t.schema_prefix()
    return [
        f"CREATE TABLE IF NOT EXISTS {t.name} (\n"
        "    scope text NOT NULL,\n"
        "    message_id text NOT NULL,\n"
        "    claimed_at real NOT NULL,\n"
        "    PRIMARY KEY (scope, message_id)\n"
        ") WITHOUT ROWID",
        f"CREATE INDEX IF NOT EXISTS {prefix}{t.bare(t.name)}_scope_claimed_at"
        f" ON {t.bare(t.name)} (scope, claimed_at)",
        f"CREATE TABLE IF NOT EXISTS {t.attempts} (\n"
        "    scope text NOT NULL,\n"
        "    message_id text NOT NULL,\n"
        "    attempt integer NOT NULL,\n"
        "    redeliveries integer NOT NULL,\n"
        "    last_at real NOT NULL,\n"
        "    PRIMARY KEY (scope, message_id, attempt)\n"
        ")",
        f"CREATE INDEX IF NOT EXISTS {prefix}{t.bare(t.attempts)}_scope_last_at"
        f" ON {t.bare(t.attempts)} (scope, last_at)",
    ]


def mysql_ddl(t: InboxTables) -> list[str]:
    """``install()`` on MariaDB and MySQL (InnoDB): the statements, each idempotent. The keys
    are varbinary, so they compare byte for byte (``utf8mb4_bin`` is PAD SPACE); two of 1,020
    bytes fit InnoDB's 3,072-byte key. DDL commits the caller's open transaction on these
    databases."""
    options = ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    key = f"varbinary({MYSQL_KEY_BYTES}) NOT NULL"
    return [
        f"CREATE TABLE IF NOT EXISTS {quote('mysql', t.name)} (\n"
        f"    scope {key},\n"
        f"    message_id {key},\n"
        "    claimed_at double NOT NULL,\n"
        "    PRIMARY KEY (scope, message_id),\n"
        f"    KEY {t.bare(t.name)}_scope_claimed_at (scope, claimed_at)\n{options}",
        f"CREATE TABLE IF NOT EXISTS {quote('mysql', t.attempts)} (\n"
        f"    scope {key},\n"
        f"    message_id {key},\n"
        "    attempt integer NOT NULL,\n"
        "    redeliveries integer NOT NULL,\n"
        "    last_at double NOT NULL,\n"
        "    PRIMARY KEY (scope, message_id, attempt),\n"
        f"    KEY {t.bare(t.attempts)}_scope_last_at (scope, last_at)\n{options}",
    ]


def mysql_migration(t: InboxTables, tables: tuple[str, ...] | None = None) -> list[str]:
    """The ALTERs that turn an inbox made before (``varchar(255)``, ``utf8mb4_bin``: PAD SPACE)
    into what ``install()`` makes now, keeping its rows (a utf8mb4 string becomes its UTF-8
    bytes; no two keys of a PAD SPACE unique key differ by trailing spaces, so none collide).
    ``tables``: only these of the two (default: both). Each rebuilds its table."""
    key = f"varbinary({MYSQL_KEY_BYTES}) NOT NULL"
    return [
        f"ALTER TABLE {quote('mysql', name)} MODIFY scope {key}, MODIFY message_id {key}"
        for name in (t.name, t.attempts)
        if tables is None or name in tables
    ]


def mysql_key_columns_sql(t: InboxTables) -> tuple[str, tuple[str, ...]]:
    """(statement, parameters) listing the key columns of the inbox's tables: table, column,
    data type, character set and collation (NULL for binary types)."""
    schema, _, name = t.name.rpartition(".")
    where = "%s" if schema else "DATABASE()"
    sql = (
        "SELECT TABLE_NAME, COLUMN_NAME, DATA_TYPE, CHARACTER_SET_NAME, COLLATION_NAME"
        f" FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = {where}"
        " AND TABLE_NAME IN (%s, %s) AND COLUMN_NAME IN ('scope', 'message_id')"
    )
    names = (name, t.bare(t.attempts))
    return sql, (schema, *names) if schema else names


_COLLATION = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def pad_space_sql(collations: list[tuple[str, str]]) -> str:
    """One SELECT that asks the server, for each (character set, collation), whether it takes
    ``'a'`` and ``'a '`` for equal (1: PAD SPACE). Asked rather than read from a list: MariaDB
    shows no pad attribute before 12.1, and MySQL's and MariaDB's names differ."""
    for charset, collation in collations:
        if not (_COLLATION.match(charset) and _COLLATION.match(collation)):
            raise ConfigurationError(f"unexpected collation name {charset!r}/{collation!r}")
    return "SELECT " + ", ".join(
        f"CONVERT('a' USING {cs}) COLLATE {co} = CONVERT('a ' USING {cs})" for cs, co in collations
    )


def pad_space_message(t: InboxTables, columns: tuple[str, ...]) -> str:
    """What ``install()`` logs and ``inbox init``/``status`` print about PAD SPACE columns."""
    tables = tuple(dict.fromkeys(c.rpartition(".")[0] for c in columns))
    alters = "; ".join(mysql_migration(t, tables))
    return (
        f"inbox {t.name}: the key columns {', '.join(columns)} compare under a PAD SPACE "
        "collation (such as utf8mb4_bin), which ignores trailing spaces: a message whose id "
        "differs from a claimed one only by trailing spaces ('order-1 ' after 'order-1') is "
        "taken for a duplicate, acked and never handled (the same for scopes). Migrate them, "
        f"keeping the claims (each ALTER rebuilds its table): {alters}; see docs/inbox.md"
    )


DDL: dict[str, Callable[[InboxTables], list[str]]] = {
    "postgresql": postgresql_ddl,
    "sqlite": sqlite_ddl,
    "mysql": mysql_ddl,
}


def ddl(dialect: str, tables: InboxTables) -> list[str]:
    """The statements ``install()`` runs on ``dialect``."""
    make = DDL.get(dialect)
    if make is None:
        raise ConfigurationError(
            f"the inbox runs on PostgreSQL, SQLite, MariaDB and MySQL; got a {dialect!r} database"
        )
    return make(tables)


# --- statements ---------------------------------------------------------------------------------


def claim_sql(dialect: str, t: InboxTables) -> str:
    """Insert a claim, or nothing when the key exists (after waiting for an uncommitted claim
    of the same key: the primary key's lock). One row changed: a new claim."""
    columns = "(scope, message_id, claimed_at) VALUES (%s, %s, %s)"
    if dialect == "postgresql":
        return f"INSERT INTO {t.name} {columns} ON CONFLICT DO NOTHING"
    if dialect == "mysql":
        # IGNORE would also turn a too-long or invalid value into a warning: the values are
        # checked before (MAX_KEY), so here it only skips the duplicate key
        return f"INSERT IGNORE INTO {quote(dialect, t.name)} {columns}"
    return f"INSERT OR IGNORE INTO {t.name} {columns}"


#: the lowest ``claimed_at`` a prune starts from (every batch then starts where the last ended)
PRUNE_FLOOR = -1e308


@dataclass(frozen=True)
class PruneStep:
    """How to delete one batch of old rows from one table. Every statement takes the parameters
    (low, cutoff, [scope,] limit): rows with ``low <= column < cutoff``, oldest first.

    Each batch starts at the newest ``column`` the last one deleted (``low``), not at the
    oldest value: on PostgreSQL, the index keeps the deleted rows' entries until a vacuum, and
    a prune that walked them again at every batch spent 235 ms a batch on a million rows
    (measured). PostgreSQL: ``fetch`` deletes a batch and answers (found, newest, deleted).
    SQLite: ``delete`` (its index drops entries at once: no low bound needed). MariaDB and
    MySQL: ``select`` reads a batch's keys and their ``column`` with a plain read, then
    ``delete_keys(n)`` deletes them by primary key (parameters: scope, n ids, cutoff). A
    ranged ``DELETE ... LIMIT`` there locks every row and gap its scan passes (REPEATABLE READ,
    InnoDB's default), which held new claims for half a second (measured); deleting by key
    locks only the rows deleted.
    """

    table: str
    column: str
    scoped: bool
    dialect: str
    fetch: str | None = None
    delete: str | None = None
    select: str | None = None

    def delete_keys(self, count: int) -> str:
        marks = ", ".join(["%s"] * count)
        return (
            f"DELETE FROM {quote(self.dialect, self.table)} WHERE scope = %s"
            f" AND message_id IN ({marks}) AND {self.column} < %s"
        )


def prune_step(dialect: str, table: str, column: str, scoped: bool = True) -> PruneStep:
    """The batch delete of one scope's rows older than a cutoff (through the index on
    ``(scope, column)``; prune takes the scopes one at a time)."""
    where = f"scope = %s AND {column} >= %s AND {column} < %s"
    if dialect == "postgresql":
        # ctid: the rows the batch found, by their physical address, in one statement
        fetch = (
            f"WITH batch AS (SELECT ctid AS row, {column} AS at FROM {table} WHERE {where}"
            f" ORDER BY {column} LIMIT %s),"
            f" gone AS (DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT row FROM batch))"
            " RETURNING 1)"
            " SELECT (SELECT count(*) FROM batch), (SELECT max(at) FROM batch),"
            " (SELECT count(*) FROM gone)"
        )
        return PruneStep(table, column, scoped, dialect, fetch=fetch)
    if dialect == "mysql":
        select = (
            f"SELECT scope, message_id, {column} FROM {quote(dialect, table)} WHERE {where}"
            f" ORDER BY {column} LIMIT %s"
        )
        return PruneStep(table, column, scoped, dialect, select=select)
    # the claims table has no rowid (WITHOUT ROWID): its key, as a row value
    key = "scope, message_id" if column == "claimed_at" else "rowid"
    delete = (
        f"DELETE FROM {table} WHERE ({key}) IN (SELECT {key} FROM {table} WHERE {where} LIMIT %s)"
    )
    return PruneStep(table, column, scoped, dialect, delete=delete)


def attempt_upsert_sql(dialect: str, t: InboxTables) -> str:
    """Count one redelivery of (scope, message_id, attempt). Parameters: scope, message_id,
    attempt, last_at."""
    values = "(scope, message_id, attempt, redeliveries, last_at) VALUES (%s, %s, %s, 1, %s)"
    if dialect == "mysql":
        return (
            f"INSERT INTO {quote(dialect, t.attempts)} {values}"
            " ON DUPLICATE KEY UPDATE redeliveries = redeliveries + 1, last_at = VALUES(last_at)"
        )
    return (
        f"INSERT INTO {t.attempts} {values} ON CONFLICT (scope, message_id, attempt)"
        f" DO UPDATE SET redeliveries = {t.bare(t.attempts)}.redeliveries + 1,"
        " last_at = excluded.last_at"
    )


def attempt_select_sql(dialect: str, t: InboxTables) -> str:
    return (
        f"SELECT redeliveries FROM {quote(dialect, t.attempts)}"
        " WHERE scope = %s AND message_id = %s AND attempt = %s"
    )


def attempt_delete_sql(dialect: str, t: InboxTables) -> str:
    """Forget a message's ledger rows (every copy), once its handling committed."""
    return f"DELETE FROM {quote(dialect, t.attempts)} WHERE scope = %s AND message_id = %s"


def scopes_sql(dialect: str, table: str) -> str:
    """The scopes that have rows in ``table`` (prune of every scope takes them in turn)."""
    return f"SELECT DISTINCT scope FROM {quote(dialect, table)}"


def status_sql(dialect: str, t: InboxTables) -> tuple[str, str]:
    """(claims: count and oldest claimed_at; ledger: count)."""
    return (
        f"SELECT count(*), min(claimed_at) FROM {quote(dialect, t.name)}",
        f"SELECT count(*) FROM {quote(dialect, t.attempts)}",
    )
