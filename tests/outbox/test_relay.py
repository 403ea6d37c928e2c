"""The relay against the real PostgreSQL and the local RabbitMQ: if and only if, nothing skipped,
failed rows, a long transaction, the database going away, relays sharing the partitions, the
writer's trace context. No mock of either."""

from __future__ import annotations

import logging
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

from reliable_amqp.outbox import Outbox, status
from support.broker import BrokerAdmin
from support.outbox import RelayThread, outbox_cli, read_ids, wait_for_count, wait_until

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
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time, psycopg
            from reliable_amqp.outbox import Outbox
            conn = psycopg.connect({pg_dsn!r})
            for i in range(50):
                Outbox().add(conn, "", {queue!r}, b"never", key="killed")
            print("ready", flush=True)
            time.sleep(600)
        """),
        ],
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
        wait_until(lambda: status(pg_dsn).pending == 0, 60, "the relay to delete what it published")
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
    with (
        psycopg.connect(pg_dsn) as a,
        psycopg.connect(pg_dsn) as b,
        psycopg.connect(pg_dsn, autocommit=True) as naive,
    ):
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


def test_refused_rows_fail_with_their_reasons_and_block_nothing_and_retry_delivers_them(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox, records: Records
) -> None:
    queue = broker.queue()
    nowhere = broker.queue()  # its name, deleted now: unroutable until it is declared again
    broker.channel.queue_delete(nowhere)
    missing_exchange = f"{queue}-x"
    with psycopg.connect(pg_dsn) as conn:
        good = [outbox.add(conn, "", queue, b"good %d" % i, key=f"k{i % 5}") for i in range(100)]
        returned = [outbox.add(conn, "", nowhere, b"returned", key="k1") for _ in range(3)]
        rejected = [
            outbox.add(conn, missing_exchange, "r", b"rejected", key="k2") for _ in range(2)
        ]
        good += [
            outbox.add(conn, "", queue, b"good %d" % i, key=f"k{i % 5}") for i in range(100, 200)
        ]
    with RelayThread(pg_dsn, amqp_url) as relay:
        assert wait_for_count(broker, queue, 200, 60) >= 200
        wait_until(lambda: status(pg_dsn).failed == 5, 30, "five failed rows")
        wait_until(lambda: status(pg_dsn).pending == 0, 30, "the good rows deleted")
    stats = relay.relay.stats()
    assert stats.failed == 5 and stats.published == 205 and stats.confirmed == 200
    # each row was published once by the relay; a 404 closes the channel under the messages
    # in flight, which the publisher sends again (at-least-once, the same ids and bodies)
    got = read_ids(broker, queue)
    assert {mid for mid, _ in got} == set(good)
    assert len({(mid, body) for mid, body in got}) == len(good)
    listed = outbox_cli("failed", "--db", pg_dsn)
    assert listed.returncode == 1, listed.stderr  # failed rows remain
    for mid in returned:
        assert mid in listed.stdout
    assert listed.stdout.count("MessageReturned") == 3 and "312 NO_ROUTE" in listed.stdout
    assert listed.stdout.count("MessageRejected") == 2 and "404" in listed.stdout
    assert len(records.warnings("moved to amqp_outbox_failed")) == 5  # reported, once each
    # the operator fixes the topology and retries: they are delivered, with their ids
    broker.queue(nowhere)
    broker.exchange(missing_exchange)
    broker.bind(nowhere, missing_exchange, "r")
    retried = outbox_cli("failed", "--db", pg_dsn, "--retry", "--json")
    assert retried.returncode == 0, retried.stderr
    assert '"retried": 5' in retried.stdout
    drained = outbox_cli("relay", "--db", pg_dsn, "--url", amqp_url, "--until-empty")
    assert drained.returncode == 0, drained.stderr
    assert sorted(mid for mid, _ in read_ids(broker, nowhere)) == sorted(returned + rejected)
    assert status(pg_dsn).failed == 0 and status(pg_dsn).pending == 0


def test_the_relay_rides_out_the_loss_of_its_database_session(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox, records: Records
) -> None:
    queue = broker.queue()
    ids: list[str] = []
    with (
        RelayThread(pg_dsn, amqp_url, rebalance_interval=0.2) as relay,
        psycopg.connect(pg_dsn, autocommit=True) as admin,
        psycopg.connect(pg_dsn) as conn,
    ):
        for round_ in range(3):
            ids += [outbox.add(conn, "", queue, b"%d" % i, key=f"k{i % 3}") for i in range(300)]
            conn.commit()
            assert wait_for_count(broker, queue, len(ids), 60) >= len(ids)
            wait_until(lambda: relay.relay.partitions, 30, "the relay to own its partitions again")
            # the relay's session (and every lock it held) is killed under it
            killed = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name LIKE 'reliable-amqp relay%%'"
                " AND application_name NOT LIKE '%%listener'"
            ).fetchall()
            assert killed, f"round {round_}: no relay session to kill"
        ids += [outbox.add(conn, "", queue, b"last") for _ in range(10)]
        conn.commit()
        assert wait_for_count(broker, queue, len(ids), 60) >= len(ids)
        wait_until(lambda: status(pg_dsn).pending == 0, 60, "every row deleted")
    got = [mid for mid, _ in read_ids(broker, queue)]
    assert set(got) == set(ids)  # nothing lost; duplicates only of what was in flight
    assert len(got) - len(ids) <= 3 * 5000
    assert len(records.warnings("lost the database")) == 3
    assert len(records.warnings("database is back")) == 3


def test_two_relays_share_the_partitions_and_publish_each_row_once(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    queue = broker.queue()
    with (
        RelayThread(pg_dsn, amqp_url, name="one", rebalance_interval=0.2) as one,
        RelayThread(pg_dsn, amqp_url, name="two", rebalance_interval=0.2) as two,
    ):
        wait_until(
            lambda: len(one.relay.partitions) == len(two.relay.partitions) == 32,
            30,
            "32 partitions each",
        )
        assert one.relay.partitions.isdisjoint(two.relay.partitions)
        shown = status(pg_dsn)
        assert sorted((r.name, r.partitions) for r in shown.relays) == [("one", 32), ("two", 32)]
        with psycopg.connect(pg_dsn) as conn:
            ids = outbox.add_many(
                conn,
                [
                    {"exchange": "", "routing_key": queue, "body": b"%d" % i,
                     "key": None if i % 4 == 0 else f"k{i % 40}"}
                    for i in range(4000)
                ],
            )  # fmt: skip
        assert wait_for_count(broker, queue, 4000, 60) == 4000
        wait_until(lambda: status(pg_dsn).pending == 0, 60, "every row deleted")
        assert one.relay.stats().published > 0 and two.relay.stats().published > 0
    got = [mid for mid, _ in read_ids(broker, queue)]
    assert sorted(got) == sorted(ids)


def test_the_writers_trace_continues_in_the_message(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    queue = broker.queue()
    with tracer.start_as_current_span("POST /orders") as span, psycopg.connect(pg_dsn) as conn:
        outbox.add(conn, "", queue, b"traced", headers={"x": 1})
    outbox_untraced = Outbox()
    with psycopg.connect(pg_dsn) as conn:
        outbox_untraced.add(conn, "", queue, b"plain")
    with RelayThread(pg_dsn, amqp_url):
        assert wait_for_count(broker, queue, 2, 30) == 2
    (traced, _), (plain, _) = broker.drain(queue)
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert traced.headers["traceparent"].split("-")[1] == trace_id
    assert traced.headers["x"] == 1
    assert not (plain.headers or {}).get("traceparent")


@pytest.mark.slow
def test_a_transaction_held_open_past_the_warning_is_shown_warned_once_and_not_skipped(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin, outbox: Outbox, records: Records
) -> None:
    # held 15 s past a 3 s long_transaction_warning (the default is 30 s): the relay's health
    # check (every HEALTH_INTERVAL, 5 s) sees it about three times and warns once
    queue = broker.queue()
    held_for = 15.0
    with (
        RelayThread(pg_dsn, amqp_url, long_transaction_warning=3.0) as relay,
        psycopg.connect(pg_dsn) as long,
        psycopg.connect(pg_dsn) as conn,
    ):
        started = time.monotonic()
        held = outbox.add(long, "", queue, b"held", key="k")
        others: list[str] = []
        while time.monotonic() - started < held_for:
            others.append(outbox.add(conn, "", queue, b"other", key="k"))
            conn.commit()
            time.sleep(1.0)  # a row a second flows while the transaction stays open
        assert wait_for_count(broker, queue, len(others), 30) == len(others)
        shown = status(pg_dsn)
        assert shown.pending == 0  # what committed went out; the held row is invisible
        assert shown.oldest_age_s is not None and shown.oldest_age_s >= held_for
        assert len(shown.open_writers) == 1 and shown.open_writers[0].age_s >= held_for
        assert len(records.warnings("a transaction open for")) == 1
        long.commit()
        assert wait_for_count(broker, queue, len(others) + 1, 30) == len(others) + 1
    assert relay.error is None
    assert [mid for mid, _ in read_ids(broker, queue)] == [*others, held]
    assert len(records.warnings("a transaction open for")) == 1
    assert status(pg_dsn).oldest_age_s is None
