"""``outbox failed --id ID --drop/--retry`` takes exactly the rows whose message id is ID, byte
for byte, on PostgreSQL, MariaDB and SQLite (issue 45, item 1: the outbox's side of the PAD
SPACE trap). The outbox table's ``utf8mb4_bin`` columns ignore trailing spaces on MariaDB and
MySQL, so ``--id m-1 --drop`` also deleted ``'m-1 '``: a message never exported, dropped. The
library's one comparison of message ids (``_tools._where``) compares bytes there."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from reliable_amqp.cli import EXIT_OK, main
from reliable_amqp.outbox._adapters import sync_writer
from support.outbox import mysql_connect, mysql_database, pg_database

IDS = ["m-1", "m-1 ", "m-1  ", "M-1"]


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def dsn(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    if request.param == "postgresql":
        with pg_database() as found:
            yield found
    elif request.param == "mariadb":
        with mysql_database() as found:
            yield found
    else:
        yield f"sqlite:///{tmp_path / 'app.db'}"


@contextlib.contextmanager
def _connect(dsn: str) -> Iterator[Any]:
    if dsn.startswith("postgresql://"):
        conn: Any = psycopg.connect(dsn)
    elif dsn.startswith("mysql://"):
        conn = mysql_connect(dsn)
    else:
        conn = sqlite3.connect(dsn[len("sqlite:///") :])
    try:
        yield conn
    finally:
        conn.close()


def _ids(dsn: str, table: str) -> list[str]:
    with _connect(dsn) as conn:
        rows = sync_writer(conn).fetch(conn, f"SELECT message_id FROM {table} ORDER BY id")
    return [r[0] for r in rows]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["outbox", *argv]) == EXIT_OK
    out: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


def test_failed_rows_are_taken_by_their_exact_message_id(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["outbox", "init", "--db", dsn]) == EXIT_OK
    with _connect(dsn) as conn:
        writer = sync_writer(conn)
        for n, message_id in enumerate(IDS, start=1):
            writer.run(
                conn,
                "INSERT INTO amqp_outbox_failed (id, message_id, part, exchange, routing_key,"
                " record, body, created_at, failed_at, attempts, reason)"
                " VALUES (%s, %s, 0, '', 'q', %s, %s, 0, 0, 1, 'returned')",
                (n, message_id, b"", b"body"),
            )
        conn.commit()
    assert _cli(capsys, "failed", "--db", dsn, "--id", "m-1", "--drop", "--json") == {
        "failed": 1,
        "dropped": 1,
    }
    assert _ids(dsn, "amqp_outbox_failed") == ["m-1 ", "m-1  ", "M-1"]
    assert _cli(capsys, "failed", "--db", dsn, "--id", "m-1 ", "--retry", "--json") == {
        "failed": 1,
        "retried": 1,
    }
    assert _ids(dsn, "amqp_outbox_failed") == ["m-1  ", "M-1"]
    assert _ids(dsn, "amqp_outbox") == ["m-1 "]
