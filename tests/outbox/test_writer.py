"""Writing into the outbox in the caller's transaction: psycopg 3 (sync and async) and sqlite3
against real databases. The write joins the caller's transaction and never commits; a message
AMQP cannot carry is refused before anything is written."""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
from decimal import Decimal

import psycopg
import pytest

from reliable_amqp import ConfigurationError, InvalidMessage
from reliable_amqp.outbox import AsyncOutbox, Outbox
from reliable_amqp.outbox._rows import PendingRow
from reliable_amqp.outbox._schema import READ_COLUMNS


def _rows(
    conn: psycopg.Connection | sqlite3.Connection, table: str = "amqp_outbox"
) -> list[PendingRow]:
    cur = conn.execute(f"SELECT {', '.join(READ_COLUMNS)} FROM {table} ORDER BY id")
    return [PendingRow.of(r) for r in cur.fetchall()]


def test_install_is_idempotent_and_the_ddl_is_what_it_runs(pg_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
        outbox.install(conn)
    with psycopg.connect(pg_dsn) as conn:
        assert _rows(conn) == []
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tablename LIKE 'amqp_outbox%'"
            ).fetchall()
        }
    assert tables == {"amqp_outbox", "amqp_outbox_failed"}
    ddl = outbox.ddl("postgresql")
    assert "CREATE TABLE IF NOT EXISTS amqp_outbox (" in ddl and "amqp_outbox_failed" in ddl


def test_a_row_exists_if_and_only_if_the_transaction_commits(pg_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
    with psycopg.connect(pg_dsn) as conn:
        kept = outbox.add(conn, "", "orders", b"kept", key="order-1")
        conn.commit()
        outbox.add(conn, "", "orders", b"rolled back", key="order-2")
        conn.rollback()
        with conn.transaction():
            inner = outbox.add(conn, "", "orders", b"nested")
    with psycopg.connect(pg_dsn) as conn:
        rows = _rows(conn)
    assert [r.message_id for r in rows] == [kept, inner]
    assert rows[0].key == "order-1" and rows[0].body == b"kept"
    message = rows[0].message()
    assert message.message_id == kept and message.mandatory is True
    assert message.properties.delivery_mode == 2


def test_add_never_commits_for_the_caller(pg_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
    with psycopg.connect(pg_dsn) as writer, psycopg.connect(pg_dsn, autocommit=True) as other:
        outbox.add(writer, "", "q", b"x")
        outbox.add_many(writer, [{"exchange": "", "routing_key": "q", "body": b"y"}])
        assert writer.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert _rows(other) == []  # nothing visible before the caller commits
        writer.commit()
        assert len(_rows(other)) == 2


def test_an_autocommit_connection_outside_a_transaction_is_refused(pg_dsn: str) -> None:
    outbox = Outbox()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        outbox.install(conn)
        with pytest.raises(ConfigurationError, match="autocommit"):
            outbox.add(conn, "", "q", b"x")
        with conn.transaction():
            outbox.add(conn, "", "q", b"inside")
        assert [r.body for r in _rows(conn)] == [b"inside"]


def test_properties_round_trip_exactly_and_the_given_id_is_kept(pg_dsn: str) -> None:
    outbox = Outbox()
    headers = {
        "n": 7,
        "price": Decimal("1.50"),
        "when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
        "tags": ["a", "b"],
        "raw": b"\x00\xff",
    }
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
        given = outbox.add(
            conn, "events", "order.created", b"{}", message_id="order-42-created",
            headers=headers, content_type="application/json", priority=3, mandatory=False,
        )  # fmt: skip
    with psycopg.connect(pg_dsn) as conn:
        (row,) = _rows(conn)
    message = row.message()
    assert given == "order-42-created" == message.message_id == row.message_id
    assert dict(message.properties.headers or {}) == headers
    assert message.properties.content_type == "application/json"
    assert message.properties.priority == 3 and message.mandatory is False


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"body": "not bytes"}, "body"),
        ({"routing_key": "r" * 256}, "routing_key"),
        ({"headers": {"x": object()}}, "headers"),
        ({"key": 5}, "key"),
        ({"priority": 300}, "priority"),
        ({"message_id": ""}, "message_id"),
    ],
)
def test_a_message_amqp_cannot_carry_is_refused_before_anything_is_written(
    sqlite_dsn: str, kwargs: dict[str, object], field: str
) -> None:
    path = sqlite_dsn.removeprefix("sqlite:///")
    outbox = Outbox()
    conn = sqlite3.connect(path)
    outbox.install(conn)
    conn.commit()
    args: dict[str, object] = {"exchange": "", "routing_key": "q", "body": b"x", **kwargs}
    with pytest.raises(InvalidMessage) as caught:
        outbox.add(conn, **args)  # type: ignore[arg-type]
    assert field in caught.value.field
    assert not conn.in_transaction  # nothing was written
    conn.close()


def test_add_many_checks_every_message_before_writing_any(sqlite_dsn: str) -> None:
    path = sqlite_dsn.removeprefix("sqlite:///")
    outbox = Outbox()
    conn = sqlite3.connect(path)
    outbox.install(conn)
    conn.commit()
    good = {"exchange": "", "routing_key": "q", "body": b"ok"}
    with pytest.raises(InvalidMessage, match=r"messages\[2\]"):
        outbox.add_many(conn, [good, good, {**good, "body": 3}])
    assert _rows(conn) == []
    ids = outbox.add_many(conn, [good, {**good, "key": "k", "properties": {"type": "t"}}])
    conn.commit()
    rows = _rows(conn)
    assert [r.message_id for r in rows] == ids and rows[1].key == "k"
    assert rows[1].message().properties.type == "t"
    conn.close()


def test_a_sqlite_connection_in_autocommit_is_refused(sqlite_dsn: str) -> None:
    path = sqlite_dsn.removeprefix("sqlite:///")
    conn = sqlite3.connect(path, isolation_level=None)
    outbox = Outbox()
    outbox.install(conn)
    with pytest.raises(ConfigurationError, match="autocommit"):
        outbox.add(conn, "", "q", b"x")
    conn.execute("BEGIN")
    outbox.add(conn, "", "q", b"x")
    conn.execute("ROLLBACK")
    assert _rows(conn) == []
    conn.close()


def test_other_connections_and_bad_table_names_are_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match=r"a psycopg 3 Connection, a sqlite3\.Connection"):
        Outbox().add(object(), "", "q", b"x")
    with pytest.raises(ConfigurationError, match="plain SQL identifier"):
        Outbox(table="orders; DROP TABLE x")


def test_the_async_outbox_writes_in_the_callers_transaction(pg_dsn: str) -> None:
    async def main() -> list[str]:
        outbox = AsyncOutbox()
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await outbox.install(conn)
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            kept = await outbox.add(conn, "", "q", b"kept", key="k")
            many = await outbox.add_many(conn, [{"exchange": "", "routing_key": "q", "body": b"m"}])
            await conn.commit()
            await outbox.add(conn, "", "q", b"gone")
            await conn.rollback()
            with pytest.raises(ConfigurationError, match="AsyncConnection"):
                await outbox.add(psycopg.connect(pg_dsn), "", "q", b"x")
        return [kept, *many]

    ids = asyncio.run(main())
    with psycopg.connect(pg_dsn) as conn:
        assert [r.message_id for r in _rows(conn)] == ids
