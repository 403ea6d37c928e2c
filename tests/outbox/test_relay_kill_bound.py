"""Duplicates after a relay is killed -9 are bounded by its in-flight window (issue 48).

A row leaves the outbox only once its confirm is in and its delete committed; a relay never has
more rows published and not yet deleted than its window (``max_in_flight``): it reads only while
the window has room, and writes what was confirmed (one ``DELETE`` a pass) before the next read.
So a relay killed mid-drain leaves at most a window of rows that the broker may have stored and
that the next relay publishes again, with the same ids.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter

import psycopg
import pytest

from reliable_amqp.outbox import Outbox, status
from reliable_amqp.outbox._relay import DEFAULT_RELAY_WINDOW
from support.broker import BrokerAdmin
from support.outbox import read_ids, wait_for_count

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROWS = 5 * DEFAULT_RELAY_WINDOW


def _relay(pg_dsn: str, amqp_url: str, *more: str) -> subprocess.Popen[str]:
    """``reliable-amqp outbox relay``, the relay users run, with its default window."""
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "reliable_amqp", "outbox", "relay"),
            *("--db", pg_dsn, "--url", amqp_url, *more),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_relay_killed_mid_drain_leaves_at_most_its_window_of_duplicates(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    outbox = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox.install(conn)
        written = outbox.add_many(
            conn,
            [{"exchange": "", "routing_key": queue, "body": b"row %d" % i} for i in range(ROWS)],
        )
    killed = _relay(pg_dsn, amqp_url)
    try:
        # mid-drain, with a full window out: kill -9, nothing settled, nothing deleted after
        assert wait_for_count(broker, queue, ROWS // 2, 120) >= ROWS // 2
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    left = status(pg_dsn).pending
    assert 0 < left < ROWS, left  # killed mid-drain
    survivor = _relay(pg_dsn, amqp_url, "--until-empty")
    assert survivor.wait(120) == 0, survivor.stderr.read() if survivor.stderr else ""
    assert status(pg_dsn).pending == 0
    got = read_ids(broker, queue)
    copies = Counter(mid for mid, _ in got)
    assert set(copies) == set(written)  # nothing lost
    expected = {mid: b"row %d" % i for i, mid in enumerate(written)}
    assert all(body == expected[mid] for mid, body in got)  # a duplicate is the same message
    duplicates = len(got) - ROWS
    print(f"{duplicates} duplicates after a kill -9 (window {DEFAULT_RELAY_WINDOW}), {left} left")
    assert max(copies.values()) <= 2
    assert duplicates <= DEFAULT_RELAY_WINDOW, duplicates
