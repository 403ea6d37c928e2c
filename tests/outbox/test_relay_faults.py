"""Per-key order under faults: writers that serialise per key (an aggregate row lock), two
relay processes, one killed -9 mid-drain and started again. Every id is delivered, first copies
arrive in per-key order, duplicates are identical, and the killed relay's keys are taken over
within seconds."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from collections import defaultdict

import psycopg
import pytest

from reliable_amqp.outbox import PARTITIONS, Outbox, status
from support.broker import BrokerAdmin
from support.outbox import read_ids, wait_for_count, wait_until

pytestmark = [pytest.mark.broker, pytest.mark.slow]

KEYS = 50
PER_KEY = 400
WRITERS = 4


def _relay(pg_dsn: str, amqp_url: str, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "reliable_amqp", "outbox", "relay"),
            *("--db", pg_dsn, "--url", amqp_url, "--name", name),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _owners(pg_dsn: str) -> dict[str, int]:
    return {r.name: r.partitions for r in status(pg_dsn).relays}


def test_per_key_order_holds_through_a_relay_killed_and_restarted(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    outbox = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
        conn.execute("CREATE TABLE aggregates (key text PRIMARY KEY, seq integer NOT NULL)")
        conn.execute(
            "INSERT INTO aggregates SELECT 'key-' || n, 0 FROM generate_series(1, %s) AS n",
            (KEYS,),
        )
    plan = [f"key-{n}" for n in range(1, KEYS + 1) for _ in range(PER_KEY)]
    random.Random(7).shuffle(plan)
    written: dict[str, tuple[str, int]] = {}  # message_id -> (key, seq)
    lock = threading.Lock()
    half_written = threading.Event()

    def writer(events: list[str]) -> None:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute("SET synchronous_commit = off")
            conn.commit()
            for key in events:
                # the aggregate's row lock serialises the writers of one key: its events are
                # numbered, written and committed in one order
                (seq,) = conn.execute(
                    "UPDATE aggregates SET seq = seq + 1 WHERE key = %s RETURNING seq", (key,)
                ).fetchone() or (0,)
                mid = outbox.add(conn, "", queue, f"{key}:{seq}".encode(), key=key)
                conn.commit()
                with lock:
                    written[mid] = (key, seq)
                    if len(written) >= len(plan) // 2:
                        half_written.set()

    relays = {"relay-a": _relay(pg_dsn, amqp_url, "relay-a")}
    relays["relay-b"] = _relay(pg_dsn, amqp_url, "relay-b")
    try:
        wait_until(lambda: _owners(pg_dsn) == {"relay-a": 32, "relay-b": 32}, 60, "a 32/32 split")
        threads = [
            threading.Thread(target=writer, args=(plan[i::WRITERS],)) for i in range(WRITERS)
        ]
        for t in threads:
            t.start()
        assert half_written.wait(300)
        assert wait_for_count(broker, queue, 2000, 60) >= 2000  # mid-drain
        relays["relay-a"].send_signal(signal.SIGKILL)
        relays["relay-a"].wait(30)
        takeover = wait_until(
            lambda: _owners(pg_dsn) == {"relay-b": PARTITIONS}, 30, "relay-b owning everything"
        )
        assert takeover < 5.0, f"the killed relay's keys were taken over after {takeover:.1f} s"
        relays["relay-a"] = _relay(pg_dsn, amqp_url, "relay-a")  # started again
        for t in threads:
            t.join(300)
        assert len(written) == KEYS * PER_KEY
        wait_until(lambda: _owners(pg_dsn) == {"relay-a": 32, "relay-b": 32}, 60, "the split again")
        wait_until(lambda: status(pg_dsn).pending == 0, 180, "every row confirmed and deleted")
        for name, process in relays.items():
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0, (
                f"{name}: {process.stderr.read() if process.stderr else ''}"
            )
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
    print(f"takeover {takeover:.2f} s, {duplicates} duplicates")
    assert duplicates <= 5000, duplicates  # at most what the killed relay had in flight
