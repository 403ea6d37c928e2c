"""The outbox's tables as SQLAlchemy ``Table`` objects, for an application's ``MetaData``: Alembic's
autogenerate then sees them and writes their migration like any other table's.

.. code-block:: python

    from sqlalchemy import MetaData
    from reliable_amqp.outbox.sqlalchemy import outbox_table

    metadata = MetaData()                  # the application's (Base.metadata with the ORM)
    outbox = outbox_table(metadata)        # amqp_outbox, and amqp_outbox_failed beside it

Each table is what ``Outbox().install()`` creates on that database (PostgreSQL, SQLite, MySQL and
MariaDB): the same columns, types, nullability and primary key, so a database made by either
one matches the other (``alembic revision --autogenerate`` finds nothing to change after
``install()``). Needs SQLAlchemy 2 (the ``outbox-sqlalchemy`` extra).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from reliable_amqp.outbox._schema import DEFAULT_TABLE, Tables

__all__ = ["failed_table", "outbox_table"]

#: PostgreSQL storage parameters of the pending table (see _schema.postgresql_ddl): vacuum
#: every 10,000 dead rows, not at 20% of the table
PG_STORAGE = {
    "autovacuum_vacuum_scale_factor": 0,
    "autovacuum_vacuum_threshold": 10000,
    "autovacuum_vacuum_insert_scale_factor": 0,
    "autovacuum_vacuum_insert_threshold": 10000,
}


#: MariaDB and MySQL table options (see _schema.mysql_ddl): a binary collation (PAD SPACE: the
#: library compares message ids as bytes where it compares them)
_MYSQL: dict[str, Any] = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
}


def _pg_with_supported() -> bool:
    """``postgresql_with`` is a Table option from SQLAlchemy 2.1 on."""
    for kind, arguments in postgresql.dialect.construct_arguments or ():
        if kind is sa.Table:
            return "with" in arguments
    return False  # pragma: no cover


def _blob() -> sa.types.TypeEngine[Any]:
    # MySQL's BLOB holds 64 KiB: a body or a header record may be larger
    return sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")


def _double() -> sa.types.TypeEngine[Any]:
    # SQLite reads "double precision" back as REAL (the same affinity); MySQL's is DOUBLE
    return (
        sa.DOUBLE_PRECISION()
        .with_variant(sa.REAL(), "sqlite")
        .with_variant(mysql.DOUBLE(asdecimal=False), "mysql", "mariadb")
    )


def _name() -> sa.types.TypeEngine[Any]:
    # an AMQP short string: at most 255 bytes (varchar(255) on MySQL, where text is not indexable)
    return sa.Text().with_variant(mysql.VARCHAR(255), "mysql", "mariadb")


def _columns() -> list[sa.Column[Any]]:
    """The columns a writer fills (``_schema.WRITE_COLUMNS``), in that order."""
    return [
        sa.Column("message_id", _name(), nullable=False),
        sa.Column("key", sa.Text, nullable=True),
        sa.Column("part", sa.SmallInteger, nullable=False),
        sa.Column("exchange", _name(), nullable=False),
        sa.Column("routing_key", _name(), nullable=False),
        sa.Column("record", _blob(), nullable=False),
        sa.Column("body", _blob(), nullable=False),
        sa.Column("traceparent", _name(), nullable=True),
        sa.Column("tracestate", sa.Text, nullable=True),
        sa.Column("created_at", _double(), nullable=False),
    ]


def _split(tables: Tables) -> tuple[str | None, str]:
    schema, _, name = tables.name.rpartition(".")
    return schema or None, name


def outbox_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """Add the outbox ``name`` (``"table"`` or ``"schema.table"``) to ``metadata``: its pending
    table (returned) and its failed table (``<name>_failed``, see :func:`failed_table`). Calling
    it again for the same metadata returns the table already there."""
    tables = Tables.named(name)
    schema, table = _split(tables)
    key = f"{schema}.{table}" if schema else table
    if key in metadata.tables:
        return metadata.tables[key]
    options: dict[str, Any] = {"sqlite_autoincrement": True, **_MYSQL}
    if _pg_with_supported():
        options["postgresql_with"] = dict(PG_STORAGE)
    pending = sa.Table(
        table,
        metadata,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            sa.Identity(always=True),
            primary_key=True,
            autoincrement=True,
        ),
        *_columns(),
        schema=schema,
        **options,
    )
    sa.Table(
        f"{table}_failed",
        metadata,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=False,
        ),
        *_columns(),
        sa.Column("failed_at", _double(), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        schema=schema,
        **_MYSQL,
    )
    return pending


def failed_table(metadata: sa.MetaData, name: str = DEFAULT_TABLE) -> sa.Table:
    """The failed table of the outbox ``name`` in ``metadata`` (added with the pending one)."""
    outbox_table(metadata, name)
    schema, table = _split(Tables.named(name))
    key = f"{schema}.{table}_failed" if schema else f"{table}_failed"
    return metadata.tables[key]
