"""The outbox table: its name, its columns and its DDL for each database, and how a row's key
maps to a partition. Values only, no I/O.

One table holds the pending rows, a second (``<table>_failed``) the rows the broker refused for
good. A relay reads pending rows through the primary key (``ORDER BY id``) and deletes them by
id once confirmed, so the primary key is the only index the hot table needs: every index more
is a write more for the application's transactions.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from reliable_amqp._core.errors import ConfigurationError

#: Keys are spread over this many partitions; a relay owns whole partitions (one owner at a
#: time), so the rows of one key are published by one relay at a time, in order. Fixed: writers
#: and relays of one table must agree on it (changing it is a migration, not an option).
PARTITIONS = 64

DEFAULT_TABLE = "amqp_outbox"

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,54}$")

#: the columns a writer fills, in the order of its INSERT
WRITE_COLUMNS = (
    "message_id",
    "key",
    "part",
    "exchange",
    "routing_key",
    "record",
    "body",
    "traceparent",
    "tracestate",
    "created_at",
)
#: what a relay reads of a pending row
READ_COLUMNS = ("id", *WRITE_COLUMNS)


@dataclass(frozen=True)
class Tables:
    """The names of one outbox: ``name`` (pending rows), ``failed`` and the lock namespace."""

    name: str
    failed: str
    #: PostgreSQL advisory-lock namespace of this outbox (first key of the two-int form)
    lock_space: int
    #: the NOTIFY channel (PostgreSQL) that wakes its relays
    channel: str

    @classmethod
    def named(cls, table: str) -> Tables:
        """The tables of the outbox ``table`` (``name`` or ``schema.name``); raises
        :class:`~reliable_amqp.ConfigurationError` for a name that is not a plain identifier."""
        if not isinstance(table, str):
            raise ConfigurationError(f"table: expected a str, got {type(table).__name__}")
        parts = table.split(".")
        if len(parts) > 2 or not all(_NAME.match(p) for p in parts):
            raise ConfigurationError(
                f"table: {table!r} is not a plain SQL identifier (letters, digits and _, "
                "at most 55 characters, optionally schema-qualified as schema.name)"
            )
        return cls(
            name=table,
            failed=f"{table}_failed",
            lock_space=zlib.crc32(table.encode()) & 0x7FFFFFFF,
            channel=table.replace(".", "_"),
        )


def partition_of(key: str | None, message_id: str) -> int:
    """The partition of a row: its key's (stable across processes and versions: CRC-32), or, for
    a row without key, its message id's (keyless rows spread over every relay)."""
    return zlib.crc32((message_id if key is None else key).encode("utf-8")) % PARTITIONS


_COMMON = """
    message_id text NOT NULL,
    key text,
    part smallint NOT NULL,
    exchange text NOT NULL,
    routing_key text NOT NULL,
    record {blob} NOT NULL,
    body {blob} NOT NULL,
    traceparent text,
    tracestate text,
    created_at double precision NOT NULL"""

_FAILED = """
    failed_at double precision NOT NULL,
    attempts integer NOT NULL,
    reason text NOT NULL"""


def postgresql_ddl(tables: Tables) -> list[str]:
    """``install()`` on PostgreSQL: the statements, each idempotent."""
    common = _COMMON.format(blob="bytea")
    return [
        # A queue table: rows are inserted, read once by the primary key, deleted. Vacuum early
        # (every 10,000 dead rows, not 20% of the table) so the relay's index walk stays short.
        f"CREATE TABLE IF NOT EXISTS {tables.name} (\n"
        f"    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,{common}\n"
        ") WITH (\n"
        "    autovacuum_vacuum_scale_factor = 0,\n"
        "    autovacuum_vacuum_threshold = 10000,\n"
        "    autovacuum_vacuum_insert_scale_factor = 0,\n"
        "    autovacuum_vacuum_insert_threshold = 10000\n"
        ")",
        f"CREATE TABLE IF NOT EXISTS {tables.failed} (\n"
        f"    id bigint PRIMARY KEY,{common},{_FAILED}\n)",
    ]


def sqlite_ddl(tables: Tables) -> list[str]:
    """``install()`` on SQLite: the statements, each idempotent. AUTOINCREMENT: ids are never
    reused, even after the newest row was deleted (a relay's bookkeeping is by id)."""
    common = _COMMON.format(blob="blob")
    return [
        f"CREATE TABLE IF NOT EXISTS {tables.name} (\n"
        f"    id integer PRIMARY KEY AUTOINCREMENT,{common}\n)",
        f"CREATE TABLE IF NOT EXISTS {tables.failed} (\n"
        f"    id integer PRIMARY KEY,{common},{_FAILED}\n)",
    ]


def mysql_quote(name: str) -> str:
    """A table name (``name`` or ``schema.name``) quoted for MariaDB and MySQL."""
    return ".".join(f"`{part}`" for part in name.split("."))


def mysql_columns(columns: Sequence[str]) -> str:
    """A column list for MariaDB and MySQL (``key`` is a reserved word there)."""
    return ", ".join(f"`{c}`" for c in columns)


_MYSQL_COMMON = """
    message_id varchar(255) NOT NULL,
    `key` text,
    part smallint NOT NULL,
    exchange varchar(255) NOT NULL,
    routing_key varchar(255) NOT NULL,
    record longblob NOT NULL,
    body longblob NOT NULL,
    traceparent varchar(255),
    tracestate text,
    created_at double NOT NULL"""


def mysql_ddl(tables: Tables) -> list[str]:
    """``install()`` on MariaDB and MySQL (InnoDB): the statements, each idempotent. Names are
    AMQP short strings (at most 255 bytes), so varchar(255) holds them. ``utf8mb4_bin`` keeps
    every character distinct but is PAD SPACE (trailing spaces ignored in comparisons): no key
    of this table is a string (the primary key is ``id``; partitions are computed in Python),
    and the one comparison of message ids (``outbox failed --id``) compares bytes
    (``CAST(message_id AS BINARY)``). DDL commits the caller's open transaction on these
    databases."""
    options = ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    return [
        f"CREATE TABLE IF NOT EXISTS {mysql_quote(tables.name)} (\n"
        f"    id bigint NOT NULL AUTO_INCREMENT PRIMARY KEY,{_MYSQL_COMMON}\n{options}",
        f"CREATE TABLE IF NOT EXISTS {mysql_quote(tables.failed)} (\n"
        f"    id bigint NOT NULL PRIMARY KEY,{_MYSQL_COMMON},\n"
        "    failed_at double NOT NULL,\n"
        "    attempts integer NOT NULL,\n"
        f"    reason text NOT NULL\n{options}",
    ]
