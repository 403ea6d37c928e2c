"""A process handling messages through the inbox is killed -9 in the middle, twice, then runs
to the end over every message again (what a broker's redeliveries amount to): each id's effect
is committed exactly once, in a table with no unique key of its own; on PostgreSQL, MariaDB and
SQLite. The consumer-level version (a Consumer killed -9 with real redeliveries) belongs to the
consumer's tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from reliable_amqp.inbox import Inbox
from support.inbox import Database

CHILD = Path(__file__).resolve().parent / "crash_child.py"
COUNT = 200


def _child(db: Database) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), db.dialect, db.dsn, str(COUNT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_killed_twice_then_run_clean_gives_each_effect_once(db: Database) -> None:
    conn = db.connect()
    Inbox("billing").install(conn)
    conn.commit()
    db.create_effects(conn)
    for kill_after in (60, 170):  # deliveries handled before the kill (of 400)
        child = _child(db)
        assert child.stdout is not None
        for _ in range(kill_after):
            line = child.stdout.readline()
            assert line.startswith("handled"), line + (child.stderr.read() if child.stderr else "")
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert child.returncode == -signal.SIGKILL
    child = _child(db)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert out.splitlines()[-1] == "done"
    effects = db.effects(conn)
    assert len(effects) == COUNT and sorted(set(effects)) == sorted(f"k{i}" for i in range(COUNT))
    conn.close()
