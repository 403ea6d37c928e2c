"""The inbox's tables as SQLAlchemy ``Table`` objects, for an application's ``MetaData``: Alembic's
autogenerate then sees them and writes their migration like any other table's.

.. code-block:: python

    from sqlalchemy import MetaData
    from reliable_amqp.inbox.sqlalchemy import inbox_table

    metadata = MetaData()                  # the application's (Base.metadata with the ORM)
    inbox = inbox_table(metadata)          # amqp_inbox, and amqp_inbox_attempts beside it

Each table is what ``Inbox(scope).install()`` creates on that database (PostgreSQL, SQLite,
MySQL and MariaDB): the same columns, types, nullability, primary key and index, so a database
made by either one matches the other. Needs SQLAlchemy 2 (the ``outbox-sqlalchemy`` extra).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from reliable_amqp.inbox._schema import DEFAULT_TABLE, MYSQL_KEY_BYTES, InboxTables
from reliable_amqp.outbox.sqlalchemy import _double

#: MariaDB and MySQL table options (see _schema.mysql_ddl: no character column is left)
_MYSQL: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}


def _name() -> sa.types.TypeEngine[Any]:
    # a key: text, which compares bytes on PostgreSQL and SQLite; varbinary on MariaDB and
    # MySQL, where utf8mb4_bin ignores trailing spaces (PAD SPACE)
    return sa.Text().with_variant(mysql.VARBINARY(MYSQL_KEY_BYTES), "mysql", "mariadb")


__all__ = ["attempts_table", "inbox_table"]


def inbox_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """Add the inbox ``name`` (``"table"`` or ``"schema.table"``) to ``metadata``: its claims
    table (returned) and its attempts ledger (``<name>_attempts``, see :func:`attempts_table`).
    Calling it again for the same metadata returns the table already there."""
    tables = InboxTables.named(name)
    schema, _, table = tables.name.rpartition(".")
    key = tables.name
    if key in metadata.tables:
        return metadata.tables[key]
    claims = sa.Table(
        table,
        metadata,
        sa.Column("scope", _name(), primary_key=True),
        sa.Column("message_id", _name(), primary_key=True),
        sa.Column("claimed_at", _double(), nullable=False),
        sa.Index(f"{table}_scope_claimed_at", "scope", "claimed_at"),
        schema=schema or None,
        sqlite_with_rowid=False,
        **_MYSQL,
    )
    sa.Table(
        f"{table}_attempts",
        metadata,
        sa.Column("scope", _name(), primary_key=True),
        sa.Column("message_id", _name(), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("redeliveries", sa.Integer, nullable=False),
        sa.Column("last_at", _double(), nullable=False),
        sa.Index(f"{table}_attempts_scope_last_at", "scope", "last_at"),
        schema=schema or None,
        **_MYSQL,
    )
    return claims


def attempts_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """The attempts ledger of the inbox ``name`` in ``metadata`` (added with the claims)."""
    inbox_table(metadata, name)
    return metadata.tables[InboxTables.named(name).attempts]
