"""The outbox on MariaDB (PyMySQL), against the real MariaDB on 127.0.0.1:3306 and the local
RabbitMQ: if and only if, the gap (InnoDB takes an AUTO_INCREMENT id at insert, so rows commit
out of id order), per-key order through two relay processes and a kill -9, failed rows and the
operator tools, the writer's checks, the wake-ups. No mock of either; each test has a database
of its own, dropped after, and a MariaDB that does not answer fails the test."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest

from reliable_amqp import ConfigurationError
from reliable_amqp.outbox import PARTITIONS, Outbox, status
from support.broker import BrokerAdmin
from support.outbox import (
    RelayThread,
    mysql_connect,
    mysql_database,
    outbox_cli,
    read_ids,
    wait_for_count,
    wait_until,
)

pytestmark = pytest.mark.broker


@pytest.fixture
def mysql_dsn() -> Iterator[str]:
    """A fresh MariaDB database (its ``mysql://`` DSN), dropped after the test."""
    with mysql_database() as dsn:
        yield dsn


@pytest.fixture
def outbox(mysql_dsn: str) -> Outbox:
    box = Outbox()
    conn = mysql_connect(mysql_dsn)
    box.install(conn)
    box.install(conn)  # idempotent
    conn.close()
    return box


def _ids_of(conn: Any, message_ids: list[str]) -> list[int]:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT id FROM amqp_outbox WHERE message_id IN ("
            + ", ".join(["%s"] * len(message_ids))
            + ") ORDER BY id",
            message_ids,
        )
        return [int(r[0]) for r in cur.fetchall()]


def test_the_documented_mysql_ddl_is_what_install_runs() -> None:
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent.parent / "docs" / "outbox.md"
    ddl = Outbox().ddl("mysql").rstrip("\n")
    assert f"```sql\n{ddl}\n```" in doc.read_text(encoding="utf-8")


# --- the writer --------------------------------------------------------------------------------


def test_the_writer_joins_the_transaction_and_refuses_autocommit_outside_one(
    mysql_dsn: str, outbox: Outbox
) -> None:
    assert "AUTO_INCREMENT" in outbox.ddl("mysql") and "`key` text" in outbox.ddl("mysql")
    auto = mysql_connect(mysql_dsn, autocommit=True)
    with pytest.raises(ConfigurationError, match="autocommit"):
        outbox.add(auto, "", "q", b"alone")
    auto.begin()  # an explicit transaction: the row joins it
    outbox.add(auto, "", "q", b"rolled back")
    auto.rollback()
    auto.begin()
    kept = outbox.add(auto, "", "q", b"\x00\xff" * 100, key="k\u00e9\U0001f600")
    auto.commit()
    plain = mysql_connect(mysql_dsn)  # PyMySQL's default: autocommit off, always in a transaction
    added = outbox.add_many(
        plain, [{"exchange": "", "routing_key": "q", "body": b"%d" % i} for i in range(3000)]
    )
    with plain.cursor() as cur:
        cur.execute("SELECT message_id, body, `key` FROM amqp_outbox ORDER BY id")
        rows = cur.fetchall()
    assert [r[0] for r in rows] == [kept, *added]  # the writer sees its own rows
    assert rows[0][1] == b"\x00\xff" * 100 and rows[0][2] == "k\u00e9\U0001f600"
    plain.rollback()
    assert status(mysql_dsn).pending == 1  # the rolled-back add_many left nothing
    auto.close()
    plain.close()


def test_status_shows_an_open_transaction_that_wrote(mysql_dsn: str, outbox: Outbox) -> None:
    held = mysql_connect(mysql_dsn)
    outbox.add(held, "", "q", b"held")
    time.sleep(2.1)
    shown = status(mysql_dsn)
    assert shown.pending == 0  # not committed: invisible
    assert len(shown.open_writers) == 1 and shown.open_writers[0].age_s >= 1
    assert shown.oldest_age_s is not None and shown.oldest_age_s >= 1
    held.commit()
    time.sleep(0.2)  # INNODB_TRX is a cache refreshed at most every 0.1 s
    shown = status(mysql_dsn)
    assert shown.pending == 1 and shown.open_writers == []
    held.close()


# --- the relay ---------------------------------------------------------------------------------


def test_exactly_the_committed_rows_reach_the_queue_on_mariadb(
    mysql_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    """900 transactions from 3 writers, a fifth rolled back, some of several rows, and a writer
    killed -9 inside an open transaction: the queue holds exactly the committed ids, each once."""
    queue = broker.queue()
    committed: list[str] = []
    lock = threading.Lock()

    def writer(seed: int, count: int) -> None:
        rng = random.Random(seed)
        conn = mysql_connect(mysql_dsn)
        for i in range(count):
            if i % 10 == 0:
                mids = outbox.add_many(
                    conn,
                    [{"exchange": "", "routing_key": queue, "body": b"%d-%d-%d" % (seed, i, n),
                      "key": f"k{n}"} for n in range(5)],
                )  # fmt: skip
            else:
                mids = [outbox.add(conn, "", queue, b"%d-%d" % (seed, i), key=f"k{i % 50}")]
            if rng.random() < 0.2:
                conn.rollback()
            else:
                conn.commit()
                with lock:
                    committed.extend(mids)
        conn.close()

    database = mysql_dsn.rsplit("/", 1)[1]
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import time, pymysql
            from reliable_amqp.outbox import Outbox
            conn = pymysql.connect(host="127.0.0.1", port=3306, user="root", database={database!r})
            for i in range(50):
                Outbox().add(conn, "", {queue!r}, b"never", key="killed")
            print("ready", flush=True)
            time.sleep(600)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    with RelayThread(mysql_dsn, amqp_url) as relay:
        assert killed.stdout is not None and killed.stdout.readline() == "ready\n"
        threads = [threading.Thread(target=writer, args=(s, 300)) for s in range(3)]
        for t in threads:
            t.start()
        killed.send_signal(signal.SIGKILL)  # inside its open transaction, while others write
        killed.wait(30)
        for t in threads:
            t.join(300)
        assert 800 < len(committed) < 1500
        assert wait_for_count(broker, queue, len(committed), 120) == len(committed)
        wait_until(
            lambda: status(mysql_dsn).pending == 0, 60, "the relay to delete what it published"
        )
    assert relay.error is None
    got = [mid for mid, _ in read_ids(broker, queue)]
    assert sorted(got) == sorted(committed)  # exactly the committed ids, each once
    assert relay.relay.stats().failed == 0


def test_a_row_that_commits_after_a_later_one_is_still_delivered_on_mariadb(
    mysql_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    """The gap on InnoDB: A writes first (AUTO_INCREMENT gives it the lower id at insert) and
    commits last; B commits in between. The relay publishes B, then A once it commits; a reader
    that remembers the last id it saw (the control) has passed A's id for good."""
    queue = broker.queue()
    a, b = mysql_connect(mysql_dsn), mysql_connect(mysql_dsn)
    naive = mysql_connect(mysql_dsn, autocommit=True)
    with naive.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    try:
        id_a = outbox.add(a, "", queue, b"A")
        (row_a,) = _ids_of(a, [id_a])
        id_b = outbox.add(b, "", queue, b"B")
        (row_b,) = _ids_of(b, [id_b])
        b.commit()
        assert 0 < row_a < row_b  # ids taken at insert: A's is lower, and A has not committed
        with naive.cursor() as cur:  # the control: "id > last seen" sees B now
            cur.execute("SELECT id FROM amqp_outbox WHERE id > 0")
            seen = [int(r[0]) for r in cur.fetchall()]
        assert seen == [row_b]
        with RelayThread(mysql_dsn, amqp_url) as relay:
            assert wait_for_count(broker, queue, 1, 30) == 1  # B, while A is still open
            a.commit()
            with naive.cursor() as cur:
                cur.execute("SELECT id FROM amqp_outbox WHERE id > %s", (max(seen),))
                assert row_a not in [int(r[0]) for r in cur.fetchall()]  # the naive reader skips A
            assert wait_for_count(broker, queue, 2, 30) == 2  # the relay does not
    finally:
        for conn in (a, b, naive):
            conn.close()
    assert relay.error is None
    assert [mid for mid, _ in read_ids(broker, queue)] == [id_b, id_a]


def test_a_commit_wakes_an_idle_relay_and_a_killed_session_loses_nothing(
    mysql_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    """No NOTIFY on MariaDB: the watcher sees the table's highest id grow. With a 30 s poll
    interval, commits from another process's connection and from this process go out within
    a fraction of a second. Then the relay's session is killed under it: it reconnects, takes
    its partitions again, and nothing is lost."""
    queue = broker.queue()
    conn = mysql_connect(mysql_dsn)
    admin = mysql_connect(mysql_dsn, autocommit=True)
    try:
        with RelayThread(mysql_dsn, amqp_url, poll_interval=30.0) as relay:
            wait_until(lambda: len(relay.relay.partitions) == PARTITIONS, 30, "the relay to start")
            time.sleep(0.5)  # idle
            ids = []
            delays = []
            for i in range(5):
                ids.append(outbox.add(conn, "", queue, b"%d" % i))
                conn.commit()
                started = time.monotonic()
                assert wait_for_count(broker, queue, i + 1, 10) == i + 1
                delays.append(time.monotonic() - started)
                time.sleep(0.2)
            assert max(delays) < 1.0, delays  # well within the 30 s poll interval
            # the relay's session (and its locks) killed: it reconnects and goes on
            with admin.cursor() as cur:
                cur.execute(
                    "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = DATABASE()"
                    " AND ID <> CONNECTION_ID()"
                )
                sessions = [int(r[0]) for r in cur.fetchall()]
                for session in sessions:
                    if session != conn.thread_id():
                        cur.execute(f"KILL {session}")
            more = [outbox.add(conn, "", queue, b"after %d" % i, key="k") for i in range(300)]
            conn.commit()
            assert wait_for_count(broker, queue, 305, 60) >= 305
            wait_until(lambda: len(relay.relay.partitions) == PARTITIONS, 30, "the partitions back")
            wait_until(lambda: status(mysql_dsn).pending == 0, 30, "every row deleted")
    finally:
        conn.close()
        admin.close()
    assert relay.error is None
    assert {mid for mid, _ in read_ids(broker, queue)} == set(ids + more)


def test_refused_rows_fail_and_the_cli_lists_and_retries_them_on_mariadb(
    mysql_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    init = outbox_cli("init", "--db", mysql_dsn)
    assert init.returncode == 0, init.stderr
    outbox = Outbox()
    queue = broker.queue()
    nowhere = broker.queue()  # its name, deleted now: unroutable until it is declared again
    broker.channel.queue_delete(nowhere)
    missing_exchange = f"{queue}-x"
    conn = mysql_connect(mysql_dsn)
    good = [outbox.add(conn, "", queue, b"good %d" % i, key=f"k{i % 5}") for i in range(100)]
    returned = [outbox.add(conn, "", nowhere, b"returned", key="k1") for _ in range(3)]
    rejected = [outbox.add(conn, missing_exchange, "r", b"rejected", key="k2") for _ in range(2)]
    good += [outbox.add(conn, "", queue, b"good %d" % i, key=f"k{i % 5}") for i in range(100, 200)]
    conn.commit()
    conn.close()
    shown = outbox_cli("status", "--db", mysql_dsn, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["pending"] == 205
    with RelayThread(mysql_dsn, amqp_url) as relay:
        assert wait_for_count(broker, queue, 200, 60) >= 200
        wait_until(lambda: status(mysql_dsn).failed == 5, 30, "five failed rows")
        wait_until(lambda: status(mysql_dsn).pending == 0, 30, "the good rows deleted")
        found = json.loads(outbox_cli("status", "--db", mysql_dsn, "--json").stdout)
        assert [r["partitions"] for r in found["relays"]] == [PARTITIONS]
    stats = relay.relay.stats()
    assert stats.failed == 5 and stats.confirmed == 200
    assert {mid for mid, _ in read_ids(broker, queue)} == set(good)
    listed = outbox_cli("failed", "--db", mysql_dsn)
    assert listed.returncode == 1, listed.stderr  # failed rows remain
    for mid in returned + rejected:
        assert mid in listed.stdout
    assert listed.stdout.count("MessageReturned") == 3
    assert listed.stdout.count("MessageRejected") == 2
    # the operator fixes the topology and retries: they are delivered, with their ids
    broker.queue(nowhere)
    broker.exchange(missing_exchange)
    broker.bind(nowhere, missing_exchange, "r")
    retried = outbox_cli("failed", "--db", mysql_dsn, "--retry", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["retried"] == 5
    drained = outbox_cli("relay", "--db", mysql_dsn, "--url", amqp_url, "--until-empty")
    assert drained.returncode == 0, drained.stderr
    assert sorted(mid for mid, _ in read_ids(broker, nowhere)) == sorted(returned + rejected)
    assert status(mysql_dsn).failed == 0 and status(mysql_dsn).pending == 0
    dropped = outbox_cli("failed", "--db", mysql_dsn, "--drop", "--json")
    assert dropped.returncode == 0 and json.loads(dropped.stdout)["dropped"] == 0


KEYS = 20
PER_KEY = 150
WRITERS = 3


def _relay(dsn: str, amqp_url: str, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "reliable_amqp", "outbox", "relay"),
            *("--db", dsn, "--url", amqp_url, "--name", name),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _split(dsn: str) -> list[int]:
    return sorted(r.partitions for r in status(dsn).relays)


@pytest.mark.slow
def test_per_key_order_holds_through_a_relay_killed_on_mariadb(
    mysql_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    """20 keys written by 3 writers that serialise per key (SELECT ... FOR UPDATE on the
    aggregate's row), drained by 2 relay processes, one killed -9 mid-drain: every id
    delivered, first copies in per-key order, duplicates identical, the killed relay's
    partitions taken over within seconds."""
    queue = broker.queue()
    conn = mysql_connect(mysql_dsn)
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE aggregates (k varchar(50) PRIMARY KEY, seq int NOT NULL)")
        cur.executemany(
            "INSERT INTO aggregates VALUES (%s, 0)", [(f"key-{n}",) for n in range(1, KEYS + 1)]
        )
    conn.commit()
    conn.close()
    plan = [f"key-{n}" for n in range(1, KEYS + 1) for _ in range(PER_KEY)]
    random.Random(7).shuffle(plan)
    written: dict[str, tuple[str, int]] = {}  # message_id -> (key, seq)
    lock = threading.Lock()
    half_written = threading.Event()

    def writer(events: list[str]) -> None:
        conn = mysql_connect(mysql_dsn)
        with conn.cursor() as cur:
            for key in events:
                # the aggregate's row lock serialises the writers of one key: its events are
                # numbered, written and committed in one order
                cur.execute("SELECT seq FROM aggregates WHERE k = %s FOR UPDATE", (key,))
                (seq,) = cur.fetchone()
                seq += 1
                cur.execute("UPDATE aggregates SET seq = %s WHERE k = %s", (seq, key))
                mid = outbox.add(conn, "", queue, f"{key}:{seq}".encode(), key=key)
                conn.commit()
                with lock:
                    written[mid] = (key, seq)
                    if len(written) >= len(plan) // 2:
                        half_written.set()
        conn.close()

    relays = {name: _relay(mysql_dsn, amqp_url, name) for name in ("relay-a", "relay-b")}
    try:
        wait_until(lambda: _split(mysql_dsn) == [32, 32], 60, "a 32/32 split")
        threads = [
            threading.Thread(target=writer, args=(plan[i::WRITERS],)) for i in range(WRITERS)
        ]
        for t in threads:
            t.start()
        assert half_written.wait(300)
        assert wait_for_count(broker, queue, 500, 60) >= 500  # mid-drain
        with lock:
            at_kill = len(written)
        relays["relay-a"].send_signal(signal.SIGKILL)
        relays["relay-a"].wait(30)
        takeover = wait_until(lambda: _split(mysql_dsn) == [PARTITIONS], 30, "one relay owning all")
        assert takeover < 5.0, f"the killed relay's keys were taken over after {takeover:.1f} s"
        for t in threads:
            t.join(300)
        assert len(written) == KEYS * PER_KEY
        wait_until(lambda: status(mysql_dsn).pending == 0, 180, "every row confirmed and deleted")
        survivor = relays["relay-b"]
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(60) == 0, survivor.stderr.read() if survivor.stderr else ""
    finally:
        for process in relays.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
    got = read_ids(broker, queue)
    assert {mid for mid, _ in got} == set(written)  # every id delivered
    first: dict[str, bytes] = {}
    order: dict[str, list[int]] = defaultdict(list)
    for mid, body in got:
        if mid in first:
            assert body == first[mid]  # a duplicate is the same message
            continue
        first[mid] = body
        key, seq = written[mid]
        assert body == f"{key}:{seq}".encode()
        order[key].append(seq)
    for key, seqs in order.items():
        assert seqs == list(range(1, PER_KEY + 1)), f"{key}: first copies out of order"
    duplicates = len(got) - len(written)
    print(f"killed at {at_kill} rows written, takeover {takeover:.2f} s, {duplicates} duplicates")
    assert duplicates <= 5000, duplicates  # at most what the killed relay had in flight


def test_a_dsn_without_database_or_a_missing_table_is_a_configuration_error(
    mysql_dsn: str,
) -> None:
    from reliable_amqp.outbox import OutboxRelay

    with pytest.raises(ConfigurationError, match="names its database"):
        OutboxRelay("mysql://root@127.0.0.1:3306/", "amqp://guest:guest@127.0.0.1/%2F")
    shown = outbox_cli("status", "--db", mysql_dsn)  # no outbox table there
    assert shown.returncode == 2 and "no outbox table amqp_outbox" in shown.stderr
    unreachable = outbox_cli("status", "--db", "mysql://root@127.0.0.1:1/nothing")
    assert unreachable.returncode == 3, unreachable.stderr
    assert "cannot be reached" in unreachable.stderr
    assert isinstance(pymysql.__version__, str)
