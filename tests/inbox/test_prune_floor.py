"""Pruning below the floor warns (issue 45, item 7): a claim pruned while its message can still
come again (a consumer's retry, a redelivery, a publisher's or the outbox relay's republish
after an outage) lets the duplicate through. ``prune()`` logs a WARNING when ``older_than`` is
below :data:`MIN_RETENTION` (one day), and ``reliable-amqp inbox prune`` prints one to stderr
when ``--older-than`` is below 1 day; both still prune as asked."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from reliable_amqp.cli import EXIT_OK, main
from reliable_amqp.cli._inbox import MIN_RETENTION_DAYS
from reliable_amqp.inbox import DEFAULT_RETENTION, MIN_RETENTION, AsyncInbox, Inbox
from support.inbox import Database, FakeDelivery, fetch, run


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """WARNING records of the inbox logger (whatever the root logger's set-up: the CLI's
    main() turns propagation off on ``reliable_amqp`` when it runs in this process)."""
    found: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                found.append(record.getMessage())

    logger = logging.getLogger("reliable_amqp.inbox")
    handler = Keep()
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def test_the_floor_is_a_day_and_below_the_default_retention() -> None:
    assert MIN_RETENTION == 86400.0 == MIN_RETENTION_DAYS * 86400
    assert MIN_RETENTION < DEFAULT_RETENTION


def test_prune_below_the_floor_warns_and_lets_the_duplicate_through(tmp_path: Path) -> None:
    db = Database("sqlite", f"sqlite:///{tmp_path / 'inbox.db'}")
    conn = db.connect()
    inbox = Inbox("billing")
    inbox.install(conn)
    conn.commit()
    with conn:
        assert inbox.claim(conn, FakeDelivery("m1")) is True
    with _warnings() as warned:
        assert inbox.prune(conn, older_than=MIN_RETENTION) == 0  # at the floor: quiet
        assert inbox.prune(conn, older_than=DEFAULT_RETENTION) == 0
    assert warned == []
    with _warnings() as warned:
        assert inbox.prune(conn, older_than=0) == 1  # pruned as asked: the live claim too
    assert len(warned) == 1
    assert "older_than=0" in warned[0] and "86400" in warned[0], warned
    assert "duplicate" in warned[0] and "billing" in warned[0], warned
    # what the warning is about: the same message, come again, is handled a second time
    with conn:
        assert inbox.claim(conn, FakeDelivery("m1")) is True
    conn.close()


def test_async_prune_below_the_floor_warns(pg_dsn: str) -> None:
    async def scenario() -> list[str]:
        conn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        inbox = AsyncInbox("billing")
        await inbox.install(conn)
        with _warnings() as warned:
            await inbox.prune(conn, older_than=3600)
            await inbox.prune(conn, older_than=MIN_RETENTION)
        await conn.close()
        return warned

    warned = asyncio.run(scenario())
    assert len(warned) == 1 and "older_than=3600" in warned[0], warned


def test_inbox_prune_below_a_day_prints_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = f"sqlite:///{tmp_path / 'inbox.db'}"
    assert main(["inbox", "init", "--db", dsn]) == EXIT_OK
    conn = Database("sqlite", dsn).connect()
    for age_h in (1, 13, 30):
        run(
            conn,
            "INSERT INTO amqp_inbox (scope, message_id, claimed_at) VALUES (%s, %s, %s)",
            ("billing", f"m{age_h}", time.time() - age_h * 3600),
        )
    conn.commit()
    capsys.readouterr()
    assert main(["inbox", "prune", "--db", dsn, "--older-than", "0.5"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert "2 rows pruned" in out
    assert err.startswith("reliable-amqp inbox prune: warning: --older-than 0.5 days"), err
    assert "below the floor of 1 day" in err and "duplicate" in err, err
    assert [r[0] for r in fetch(conn, "SELECT message_id FROM amqp_inbox")] == ["m1"]
    assert main(["inbox", "prune", "--db", dsn, "--older-than", "1", "--json"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert err == "" and out.strip() == '{"pruned": 0}'
    conn.close()
