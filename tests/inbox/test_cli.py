"""``reliable-amqp inbox init|status|prune`` on each database (run in-process through
``reliable_amqp.cli.main``): init is idempotent, status --json gives rows, oldest_age_s and the
ledger's size, prune removes what is older than the retention and keeps the rest."""

from __future__ import annotations

import json
import time

import pytest

from reliable_amqp.cli import EXIT_CONNECTION, EXIT_OK, EXIT_USAGE, main
from reliable_amqp.cli._inbox import DEFAULT_RETENTION_DAYS, DEFAULT_TABLE
from reliable_amqp.inbox import DEFAULT_RETENTION, Inbox
from reliable_amqp.inbox import DEFAULT_TABLE as LIBRARY_TABLE
from support.inbox import Database, FakeDelivery


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(list(argv)) == EXIT_OK
    out: dict[str, object] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


def test_init_status_prune(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    for action in ("status", "prune"):  # before init: the missing table is named
        assert main(["inbox", action, "--db", db.dsn]) == EXIT_USAGE
        assert "no inbox table amqp_inbox" in capsys.readouterr().err
    for _ in range(2):
        assert main(["inbox", "init", "--db", db.dsn]) == EXIT_OK
    assert "ready" in capsys.readouterr().out
    empty = _json(capsys, "inbox", "status", "--db", db.dsn, "--json")
    assert empty == {"rows": 0, "oldest_age_s": None, "attempts": 0, "pad_space_columns": []}
    conn = db.connect()
    inbox = Inbox("billing")
    for i in range(5):
        assert inbox.claim(conn, FakeDelivery(f"new-{i}"))
    mark = "?" if db.dialect == "sqlite" else "%s"
    old = time.time() - 3 * 86400
    conn.cursor().executemany(
        f"INSERT INTO amqp_inbox (scope, message_id, claimed_at) VALUES ({mark}, {mark}, {mark})",
        [("shipping", f"old-{i}", old) for i in range(7)],
    )
    conn.commit()
    assert inbox.record_attempt(db.connect, FakeDelivery("new-9", redelivered=True)) == 2
    found = _json(capsys, "inbox", "status", "--db", db.dsn, "--json")
    assert found["rows"] == 12 and found["attempts"] == 1
    assert 3 * 86400 - 5 < float(found["oldest_age_s"]) < 3 * 86400 + 120  # type: ignore[arg-type]
    pruned = _json(
        capsys, "inbox", "prune", "--db", db.dsn, "--older-than", "1", "--batch", "2", "--json"
    )
    assert pruned == {"pruned": 7}
    after = _json(capsys, "inbox", "status", "--db", db.dsn, "--json")
    assert after["rows"] == 5
    assert main(["inbox", "status", "--db", db.dsn]) == EXIT_OK
    assert "rows" in capsys.readouterr().out
    conn.close()


def test_print_ddl_bad_input_and_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inbox", "init", "--db", "mysql://root@127.0.0.1/x", "--print-ddl"]) == EXIT_OK
    assert "ENGINE=InnoDB" in capsys.readouterr().out
    assert main(["inbox", "status", "--db", "sqlite:///x.db", "--table", "no good"]) == EXIT_USAGE
    assert "not a plain SQL identifier" in capsys.readouterr().err
    assert main(["inbox", "status", "--db", "postgresql://postgres@127.0.0.1:1/x"]) == (
        EXIT_CONNECTION
    )
    assert "cannot be reached" in capsys.readouterr().err


def test_the_cli_defaults_are_the_librarys() -> None:
    assert DEFAULT_TABLE == LIBRARY_TABLE
    assert DEFAULT_RETENTION_DAYS * 86400 == DEFAULT_RETENTION
