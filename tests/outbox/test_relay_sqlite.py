"""The outbox on SQLite, the embedded default: the same guarantees from a file, with the relay in
a thread or in another process (one relay at a time: a second one waits as a standby)."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from reliable_amqp.outbox import PARTITIONS, Outbox, status
from support.broker import BrokerAdmin
from support.outbox import RelayThread, read_ids, wait_for_count, wait_until

pytestmark = pytest.mark.broker


def _open(dsn: str) -> sqlite3.Connection:
    conn = sqlite3.connect(dsn.removeprefix("sqlite:///"), timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")  # the application's choice; the relay reads beside
    return conn


def _install(dsn: str) -> Outbox:
    outbox = Outbox()
    conn = _open(dsn)
    outbox.install(conn)
    conn.commit()
    conn.close()
    return outbox


def test_exactly_the_committed_rows_reach_the_queue_on_sqlite(
    sqlite_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    """10,000 transactions, 20% rolled back, a writer killed -9 inside an open transaction."""
    outbox = _install(sqlite_dsn)
    queue = broker.queue()
    path = sqlite_dsn.removeprefix("sqlite:///")
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sqlite3, time
                from reliable_amqp.outbox import Outbox
                conn = sqlite3.connect({path!r})
                for i in range(50):
                    Outbox().add(conn, "", {queue!r}, b"never", key="killed")
                print("ready", flush=True)
                time.sleep(600)
            """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert killed.stdout is not None and killed.stdout.readline() == "ready\n"
    killed.send_signal(signal.SIGKILL)  # holding SQLite's write lock, in an open transaction
    killed.wait(30)
    committed: list[str] = []
    rng = random.Random(3)
    with RelayThread(sqlite_dsn, amqp_url) as relay:
        conn = _open(sqlite_dsn)
        conn.execute("PRAGMA synchronous=NORMAL")
        for i in range(10_000):
            mid = outbox.add(conn, "", queue, b"%d" % i, key=f"k{i % 20}")
            if rng.random() < 0.2:
                conn.rollback()
            else:
                conn.commit()
                committed.append(mid)
        conn.close()
        assert wait_for_count(broker, queue, len(committed), 120) == len(committed)
        wait_until(lambda: status(sqlite_dsn).pending == 0, 60, "every row deleted")
    assert relay.error is None
    got = [mid for mid, _ in read_ids(broker, queue)]
    assert sorted(got) == sorted(committed)


def test_a_row_added_in_the_relays_process_goes_out_at_once(
    sqlite_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    outbox = _install(sqlite_dsn)
    queue = broker.queue()
    with RelayThread(sqlite_dsn, amqp_url, poll_interval=30.0) as relay:
        wait_until(lambda: len(relay.relay.partitions) == PARTITIONS, 30, "the relay to start")
        conn = _open(sqlite_dsn)
        outbox.add(conn, "", queue, b"now")
        conn.commit()
        # well within the 30 s poll interval: the commit woke the relay
        assert wait_for_count(broker, queue, 1, 10) == 1
        conn.close()


def test_a_second_relay_waits_and_takes_over_when_the_first_is_killed(
    sqlite_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    outbox = _install(sqlite_dsn)
    queue = broker.queue()

    def relay(name: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "reliable_amqp", "outbox", "relay"),
                *("--db", sqlite_dsn, "--url", amqp_url, "--name", name),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def holder() -> list[str]:
        shown = subprocess.run(
            [sys.executable, "-m", "reliable_amqp", "outbox", "status", "--db", sqlite_dsn,
             "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        found = json.loads(shown.stdout)
        assert set(found) >= {"pending", "failed", "oldest_age_s", "relays"}
        return [r["name"] for r in found["relays"]]

    first = relay("first")
    wait_until(lambda: holder() == ["first"], 30, "the first relay to hold the outbox")
    second = relay("second")
    try:
        conn = _open(sqlite_dsn)
        ids = [outbox.add(conn, "", queue, b"%d" % i) for i in range(500)]
        conn.commit()
        assert wait_for_count(broker, queue, 500, 30) == 500
        assert holder() == ["first"]  # the second waits
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        wait_until(lambda: holder() == ["second"], 10, "the second relay to take over")
        ids += [outbox.add(conn, "", queue, b"%d" % i) for i in range(500)]
        conn.commit()
        conn.close()
        assert wait_for_count(broker, queue, 1000, 30) >= 1000
        wait_until(lambda: status(sqlite_dsn).pending == 0, 30, "every row deleted")
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert {mid for mid, _ in read_ids(broker, queue)} == set(ids)


def test_failed_rows_exported_and_dropped_are_published_again_from_the_file(
    sqlite_dsn: str, amqp_url: str, broker: BrokerAdmin, tmp_path: object
) -> None:
    outbox = _install(sqlite_dsn)
    queue = broker.queue()
    broker.channel.queue_delete(queue)  # unroutable for now
    conn = _open(sqlite_dsn)
    ids = [outbox.add(conn, "", queue, b"body %d" % i, headers={"n": i}) for i in range(2)]
    conn.commit()
    conn.close()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "reliable_amqp", *args],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    relayed = cli("outbox", "relay", "--db", sqlite_dsn, "--url", amqp_url, "--until-empty")
    assert relayed.returncode == 0, relayed.stderr
    assert relayed.stderr.count("moved to amqp_outbox_failed") == 2
    exported = f"{tmp_path}/failed.jsonl"
    done = cli("outbox", "failed", "--db", sqlite_dsn, "--export", exported, "--drop", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"failed": 2, "exported": 2, "dropped": 2}
    assert status(sqlite_dsn).failed == 0
    broker.queue(queue)
    again = cli("publish", "--format", "jsonl", "--url", amqp_url, exported)
    assert again.returncode == 0, again.stderr
    got = broker.drain(queue)
    assert [p.message_id for p, _ in got] == ids
    assert [b for _, b in got] == [b"body 0", b"body 1"]
    assert [p.headers["n"] for p, _ in got] == [0, 1]
