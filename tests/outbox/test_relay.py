"""The relay against the real PostgreSQL and the local RabbitMQ: if and only if, nothing skipped,
failed rows, a long transaction, the database going away, relays sharing the partitions, the
writer's trace context. No mock of either."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from broker_support import BrokerAdmin
from outbox_support import RelayThread, read_ids, wait_for_count
from reliable_amqp.outbox import Outbox, status

pytestmark = pytest.mark.broker


class Records(logging.Handler):
    """The outbox logger's records (attached to it directly: the CLI's tests may have turned
    propagation off on ``reliable_amqp`` in this process)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self, text: str) -> list[str]:
        return [
            r.getMessage()
            for r in self.records
            if r.levelno == logging.WARNING and text in r.getMessage()
        ]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("reliable_amqp.outbox")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture
def outbox(pg_dsn: str) -> Outbox:
    box = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        box.install(conn)
    return box


def _wait(predicate: object, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_exactly_the_committed_rows_reach_the_queue(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    """10,000 transactions from 4 writers, 20% rolled back, and a writer killed -9 inside an
    open transaction: the queue holds exactly the committed ids, each once."""
    queue = broker.queue()
    committed: list[str] = []
    lock = threading.Lock()

    def writer(seed: int, count: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(pg_dsn) as conn:
            # durability of the writers' commits is not what is tested: their atomicity is
            conn.execute("SET synchronous_commit = off")
            conn.commit()
            for i in range(count):
                mid = outbox.add(conn, "", queue, b"%d-%d" % (seed, i), key=f"k{i % 50}")
                if rng.random() < 0.2:
                    conn.rollback()
                else:
                    conn.commit()
                    with lock:
                        committed.append(mid)

    killed = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time, psycopg
            from reliable_amqp.outbox import Outbox
            conn = psycopg.connect({pg_dsn!r})
            for i in range(50):
                Outbox().add(conn, "", {queue!r}, b"never", key="killed")
            print("ready", flush=True)
            time.sleep(600)
        """)],  # fmt: skip
        stdout=subprocess.PIPE,
        text=True,
    )
    with RelayThread(pg_dsn, amqp_url) as relay:
        assert killed.stdout is not None and killed.stdout.readline() == "ready\n"
        threads = [threading.Thread(target=writer, args=(s, 2500)) for s in range(4)]
        for t in threads:
            t.start()
        killed.send_signal(signal.SIGKILL)  # inside its open transaction, while others write
        killed.wait(30)
        for t in threads:
            t.join(300)
        assert 7000 < len(committed) < 9000
        assert wait_for_count(broker, queue, len(committed), 120) == len(committed)
        _wait(lambda: status(pg_dsn).pending == 0, 60, "the relay to delete what it published")
    assert relay.error is None
    got = [mid for mid, _ in read_ids(broker, queue)]
    assert sorted(got) == sorted(committed)  # exactly the committed ids, each once
    assert relay.relay.stats().failed == 0


def test_a_row_that_commits_after_a_later_one_is_still_delivered(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    """The gap: A writes first (the lower id) and commits last; B commits in between. The
    relay publishes B, then A once it commits; a reader that remembers the last id it saw
    (the control) has passed A's id for good."""
    queue = broker.queue()
    find = "SELECT id FROM amqp_outbox WHERE message_id = %s"
    with psycopg.connect(pg_dsn) as a, psycopg.connect(pg_dsn) as b, psycopg.connect(
        pg_dsn, autocommit=True
    ) as naive:
        id_a = outbox.add(a, "", queue, b"A")
        (row_a,) = a.execute(find, (id_a,)).fetchone() or (0,)
        id_b = outbox.add(b, "", queue, b"B")
        (row_b,) = b.execute(find, (id_b,)).fetchone() or (0,)
        b.commit()
        assert 0 < row_a < row_b
        # the control: "id > last seen" sees B now, so its next read starts after B
        seen = [r[0] for r in naive.execute("SELECT id FROM amqp_outbox WHERE id > 0").fetchall()]
        assert seen == [row_b]
        with RelayThread(pg_dsn, amqp_url) as relay:
            assert wait_for_count(broker, queue, 1, 30) == 1  # B, while A is still open
            a.commit()
            after = naive.execute("SELECT id FROM amqp_outbox WHERE id > %s", (max(seen),))
            assert row_a not in [r[0] for r in after.fetchall()]  # the naive reader skips A
            assert wait_for_count(broker, queue, 2, 30) == 2  # the relay does not
    assert relay.error is None
    assert [mid for mid, _ in read_ids(broker, queue)] == [id_b, id_a]
