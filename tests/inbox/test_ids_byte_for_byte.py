"""Ids and scopes compare byte for byte on every database the inbox supports (issue 45, item 1).

MariaDB's and MySQL's ``utf8mb4_bin`` is a PAD SPACE collation: trailing spaces are ignored in
comparisons and unique keys, so an inbox keyed on it took ``'order-1 '`` for a duplicate of
``'order-1'`` and a second customer's charge was acked and never ran. The inbox's keys are
VARBINARY there now; PostgreSQL's deterministic collations and SQLite's BINARY collation
compare bytes already (trailing spaces, case, composed against decomposed accents). A table
made before keeps its PAD SPACE columns: ``install()`` logs a WARNING naming them and the
ALTER to run, ``status()`` lists them, and ``inbox init`` / ``inbox status`` print it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from reliable_amqp.cli import EXIT_OK, main
from reliable_amqp.inbox import Inbox, status
from reliable_amqp.inbox._schema import InboxTables, mysql_migration
from reliable_amqp.outbox._adapters import sync_writer
from support.inbox import Database, FakeDelivery, fetch, run
from support.outbox import PG_ADMIN, PG_HOST, PG_PORT, mysql_connect

#: each differs from the first by bytes only: trailing or leading spaces, case, and "café"
#: composed (U+00E9) against decomposed (e + U+0301)
IDS = ["order-1", "order-1 ", "order-1  ", " order-1", "Order-1", "caf\u00e9", "cafe\u0301"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def _installed(db: Database) -> Any:
    conn = db.connect()
    Inbox("-").install(conn)
    conn.commit()
    return conn


def _claim(inbox: Inbox, conn: Any, message_id: str) -> bool:
    with sync_writer(conn).transaction(conn):
        return inbox.claim(conn, FakeDelivery(message_id))


def test_ids_that_differ_only_by_bytes_are_claimed_apart(db: Database) -> None:
    conn = _installed(db)
    inbox = Inbox("billing")
    assert [_claim(inbox, conn, i) for i in IDS] == [True] * len(IDS)
    assert [_claim(inbox, conn, i) for i in IDS] == [False] * len(IDS)  # each one's duplicate
    stored = {_text(r[0]) for r in fetch(conn, "SELECT message_id FROM amqp_inbox")}
    conn.commit()
    assert stored == set(IDS)  # kept as given, trailing spaces included
    conn.close()


def test_scopes_that_differ_only_by_trailing_spaces_are_apart(db: Database) -> None:
    conn = _installed(db)
    db.create_effects(conn)

    def effect(delivery: FakeDelivery, c: Any) -> None:
        run(c, "INSERT INTO effects (message_id, note) VALUES (%s, %s)", (delivery.message_id, "x"))

    one, two = Inbox("billing"), Inbox("billing ")
    for inbox in (one, two, one, two):
        inbox.handler(db.connect, effect)(FakeDelivery("m1"))
    assert db.effects(conn) == ["m1", "m1"]  # one effect for each scope
    assert (one.stats.claimed, one.stats.duplicates) == (1, 1)
    assert (two.stats.claimed, two.stats.duplicates) == (1, 1)
    # prune keeps the scopes apart too, and every scope's rows go with all_scopes
    old = time.time() - 3 * 86400
    for scope in ("billing", "billing "):
        run(
            conn,
            "INSERT INTO amqp_inbox (scope, message_id, claimed_at) VALUES (%s, %s, %s)",
            (scope, "old", old),
        )
    conn.commit()
    assert one.prune(conn, older_than=2 * 86400) == 1
    scopes = sorted(_text(r[0]) for r in fetch(conn, "SELECT scope FROM amqp_inbox"))
    conn.commit()
    assert scopes == ["billing", "billing ", "billing "]
    assert one.prune(conn, older_than=2 * 86400, all_scopes=True) == 1
    assert sorted(_text(r[0]) for r in fetch(conn, "SELECT scope FROM amqp_inbox")) == [
        "billing",
        "billing ",
    ]
    conn.commit()
    conn.close()


def test_postgresql_compares_bytes_under_a_linguistic_default_collation() -> None:
    """A database whose default collation is ICU's en-US (deterministic, as a database default
    must be on PostgreSQL 15): equal only when the bytes are, so no id is taken for another."""
    name = "ra_test_icu_" + str(int(time.time() * 1e6))
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(
            f"CREATE DATABASE {name} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US'"
        )
    try:
        db = Database("postgresql", f"postgresql://postgres@{PG_HOST}:{PG_PORT}/{name}")
        conn = _installed(db)
        assert fetch(conn, "SELECT daticulocale FROM pg_database WHERE datname = %s", (name,)) == [
            ("en-US",)
        ]
        inbox = Inbox("billing")
        assert [_claim(inbox, conn, i) for i in IDS] == [True] * len(IDS)
        assert [_claim(inbox, conn, i) for i in IDS] == [False] * len(IDS)
        conn.close()
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_the_attempts_ledger_counts_ids_apart(db: Database) -> None:
    conn = _installed(db)
    conn.close()
    inbox = Inbox("billing")
    assert inbox.record_attempt(db.connect, FakeDelivery("m", redelivered=True)) == 2
    assert inbox.record_attempt(db.connect, FakeDelivery("m", redelivered=True)) == 3
    assert inbox.record_attempt(db.connect, FakeDelivery("m ", redelivered=True)) == 2


# --- a table made before: PAD SPACE columns, found and named --------------------------------

#: the MariaDB/MySQL DDL of reliable_amqp up to this change (utf8mb4_bin: PAD SPACE)
LEGACY_DDL = [
    "CREATE TABLE amqp_inbox (scope varchar(255) NOT NULL, message_id varchar(255) NOT NULL,"
    " claimed_at double NOT NULL, PRIMARY KEY (scope, message_id),"
    " KEY amqp_inbox_scope_claimed_at (scope, claimed_at))"
    " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
    "CREATE TABLE amqp_inbox_attempts (scope varchar(255) NOT NULL,"
    " message_id varchar(255) NOT NULL, attempt integer NOT NULL,"
    " redeliveries integer NOT NULL, last_at double NOT NULL,"
    " PRIMARY KEY (scope, message_id, attempt),"
    " KEY amqp_inbox_attempts_scope_last_at (scope, last_at))"
    " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin",
]

PADDED = (
    "amqp_inbox.scope",
    "amqp_inbox.message_id",
    "amqp_inbox_attempts.scope",
    "amqp_inbox_attempts.message_id",
)


@contextlib.contextmanager
def _inbox_log() -> Iterator[list[logging.LogRecord]]:
    """The inbox logger's records, whatever the root logger's set-up (the CLI's main() turns
    propagation off on ``reliable_amqp`` when it runs in this process)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("reliable_amqp.inbox")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_pad_space_table_is_named_with_the_alter_that_migrates_it(
    mysql_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = mysql_connect(mysql_dsn)
    for statement in LEGACY_DDL:
        run(conn, statement)
    inbox = Inbox("billing")
    assert _claim(inbox, conn, "order-1") is True
    assert _claim(inbox, conn, "order-1 ") is False  # the trap, on the table made before
    with _inbox_log() as records:
        inbox.install(conn)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    for column in PADDED:
        assert column in warnings[0]
    for statement in mysql_migration(InboxTables.named("amqp_inbox")):
        assert statement in warnings[0]
    assert status(mysql_dsn).pad_space_columns == PADDED
    for action in ("status", "init"):
        assert main(["inbox", action, "--db", mysql_dsn]) == EXIT_OK
        err = capsys.readouterr().err
        assert "PAD SPACE" in err and "ALTER TABLE `amqp_inbox` MODIFY" in err, err
    assert main(["inbox", "status", "--db", mysql_dsn, "--json"]) == EXIT_OK
    assert '"pad_space_columns": ["amqp_inbox.scope"' in capsys.readouterr().out

    # the migration the warning (and docs/inbox.md) shows keeps the claims and fixes the trap
    for statement in mysql_migration(InboxTables.named("amqp_inbox")):
        run(conn, statement)
    with _inbox_log() as records:
        inbox.install(conn)
    assert [r for r in records if r.levelno >= logging.WARNING] == []
    assert status(mysql_dsn).pad_space_columns == ()
    assert main(["inbox", "status", "--db", mysql_dsn]) == EXIT_OK
    assert capsys.readouterr().err == ""
    assert _claim(inbox, conn, "order-1") is False
    assert _claim(inbox, conn, "order-1 ") is True
    conn.close()
