"""Test support for the inbox: Delivery-like values, and one database of a test's own behind the
same few calls whatever its kind (PostgreSQL through psycopg, MariaDB through PyMySQL, SQLite
through sqlite3)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any

import psycopg

from reliable_amqp.outbox._adapters import sync_writer
from support.outbox import mysql_connect


@dataclass(frozen=True)
class FakeDelivery:
    """What the inbox reads of a delivery (the duck type of ``reliable_amqp.Delivery``)."""

    message_id: str | None
    redelivered: bool = False
    headers: dict[str, Any] = field(default_factory=dict)
    attempt: int = 1
    body: bytes = b""


def run(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> int:
    """One statement (``%s`` marks) on any connection the inbox takes."""
    return sync_writer(conn).run(conn, sql, params)


def fetch(conn: Any, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return sync_writer(conn).fetch(conn, sql, params)


@dataclass
class Database:
    """A test's database: ``connect()`` gives a new connection with transactions (autocommit
    off), ``dialect`` its SQL."""

    dialect: str
    dsn: str

    def connect(self) -> Any:
        if self.dialect == "postgresql":
            return psycopg.connect(self.dsn)
        if self.dialect == "mysql":
            conn = mysql_connect(self.dsn)
            # the test waits on row locks for seconds at most, not the default 50
            with conn.cursor() as cur:
                cur.execute("SET SESSION innodb_lock_wait_timeout = 20")
            return conn
        conn = sqlite3.connect(self.dsn[len("sqlite:///") :], timeout=20, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    def create_effects(self, conn: Any) -> None:
        """The handler's own table: no unique key, so each effect applied twice shows."""
        run(conn, "CREATE TABLE effects (message_id varchar(255) NOT NULL, note text)")
        conn.commit()

    def effects(self, conn: Any) -> list[str]:
        rows = fetch(conn, "SELECT message_id FROM effects ORDER BY message_id")
        conn.commit()
        return [r[0] for r in rows]
