"""PAD SPACE key columns on MariaDB and MySQL: an inbox table made before its keys became
varbinary (``varchar`` in ``utf8mb4_bin``, which ignores trailing spaces) takes ``'order-1 '``
for a duplicate of ``'order-1'``. ``install()`` logs a WARNING naming such columns and the
ALTER that migrates them; ``status()`` lists them. See ``_schema.mysql_migration``."""

from __future__ import annotations

import logging
from typing import Any

from reliable_amqp.inbox import _schema
from reliable_amqp.inbox._schema import InboxTables
from reliable_amqp.outbox._adapters import AsyncWriter, SyncWriter

log = logging.getLogger("reliable_amqp.inbox")

#: (table, column, data type, character set, collation) of a key column
Column = tuple[Any, ...]


def as_text(value: Any) -> str:
    """A key read back: ``bytes`` from MariaDB's and MySQL's varbinary columns, else str."""
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def _ordered(tables: InboxTables, rows: list[Column]) -> list[tuple[str, str, str, str, str]]:
    """The key columns as (label, type, charset, collation, table): claims table first, scope
    before message_id; labels carry the tables' full names."""
    full = {tables.bare(tables.name): tables.name, tables.bare(tables.attempts): tables.attempts}
    order = {tables.name: 0, tables.attempts: 1, "scope": 0, "message_id": 1}
    found = []
    for row in rows:
        table, column, kind, charset, collation = (as_text(v or "") for v in row)
        found.append((full.get(table, table), column, kind.lower(), charset, collation))
    found.sort(key=lambda r: (order.get(r[0], 2), order.get(r[1], 2)))
    return [(f"{t}.{c}", d, cs, co, t) for t, c, d, cs, co in found]


def _pairs(columns: list[tuple[str, str, str, str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((cs, co) for _, _, cs, co, _ in columns if co))


def _padded(
    columns: list[tuple[str, str, str, str, str]], answers: dict[tuple[str, str], bool]
) -> tuple[str, ...]:
    """The labels of the columns that ignore trailing spaces: a character column whose
    collation pads, or any ``char`` (it drops trailing spaces when stored)."""
    return tuple(c[0] for c in columns if c[1] == "char" or answers.get((c[2], c[3]), False))


def pad_space_columns(writer: SyncWriter, conn: Any, tables: InboxTables) -> tuple[str, ...]:
    """The inbox's key columns (``table.column``) that ignore trailing spaces; () when none
    (binary or NO PAD columns, as ``install()`` makes them)."""
    sql, params = _schema.mysql_key_columns_sql(tables)
    columns = _ordered(tables, writer.fetch(conn, sql, params))
    pairs = _pairs(columns)
    answers: dict[tuple[str, str], bool] = {}
    if pairs:
        row = writer.fetch(conn, _schema.pad_space_sql(pairs))[0]
        answers = {pair: bool(v) for pair, v in zip(pairs, row, strict=True)}
    return _padded(columns, answers)


async def async_pad_space_columns(
    writer: AsyncWriter, conn: Any, tables: InboxTables
) -> tuple[str, ...]:
    """:func:`pad_space_columns`, awaited."""
    sql, params = _schema.mysql_key_columns_sql(tables)
    columns = _ordered(tables, await writer.fetch(conn, sql, params))
    pairs = _pairs(columns)
    answers: dict[tuple[str, str], bool] = {}
    if pairs:
        row = (await writer.fetch(conn, _schema.pad_space_sql(pairs)))[0]
        answers = {pair: bool(v) for pair, v in zip(pairs, row, strict=True)}
    return _padded(columns, answers)


def warn_pad_space(tables: InboxTables, columns: tuple[str, ...]) -> None:
    """Log the WARNING ``install()`` gives for PAD SPACE key columns (nothing when none)."""
    if columns:
        log.warning(_schema.pad_space_message(tables, columns))


def check(writer: SyncWriter, conn: Any, tables: InboxTables) -> None:
    """``install()`` on MariaDB and MySQL: warn about PAD SPACE key columns."""
    warn_pad_space(tables, pad_space_columns(writer, conn, tables))


async def async_check(writer: AsyncWriter, conn: Any, tables: InboxTables) -> None:
    """:func:`check`, awaited."""
    warn_pad_space(tables, await async_pad_space_columns(writer, conn, tables))
