"""Issue 40, "The chain": writers commit a business row and an outbox message in one
transaction (every 5th transaction rolled back); a relay process publishes them and is killed -9
once while the writer still writes; a consumer process handles them through ``Inbox.handler``,
writing its effect and its own outgoing outbox message in the claim's transaction, and is killed
-9 once mid-run. At the end exactly the committed orders have their effect, once each, and the
consumer's outbox holds exactly one outgoing message per committed order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import psycopg
import pytest

from reliable_amqp.inbox import Inbox
from reliable_amqp.outbox import Outbox, status
from support.broker import BrokerAdmin, unique
from support.inbox import Database
from support.inbox_consumer import Children, wait_until
from support.outbox import pg_database

pytestmark = [pytest.mark.broker, pytest.mark.faults, pytest.mark.slow]

TRANSACTIONS = 1250
COMMITTED = TRANSACTIONS - TRANSACTIONS // 5
#: the writer pauses at the first until the relay has been seen publishing, and at the second
#: until the relay was killed: the kill lands while the relay is at work, and the writer still
#: has rows to write for the relay started after it
PAUSE_AT = 500
HOLD_AT = 900


@pytest.fixture
def orders_dsn() -> Iterator[str]:
    """The order service's database: orders and its outbox."""
    with pg_database() as dsn:
        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE TABLE orders (id text PRIMARY KEY, amount integer NOT NULL)")
            Outbox().install(conn)
        yield dsn


@pytest.fixture
def billing_db() -> Iterator[Database]:
    """The billing service's database: its inbox, its payments (no unique key of their own),
    its outbox (not relayed here: the test counts its rows)."""
    with pg_database() as dsn:
        with psycopg.connect(dsn) as conn:
            Inbox("billing").install(conn)
            Outbox().install(conn)
            conn.execute("CREATE TABLE payments (order_id text NOT NULL, amount integer)")
        yield Database("postgresql", dsn)


def _relay(dsn: str, url: str, name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "reliable_amqp", "outbox", "relay", "--db", dsn, "--url", url,
         "--name", name],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def test_writers_relay_and_inbox_consumer_killed_give_each_committed_effect_once(
    orders_dsn: str,
    billing_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    children: Callable[..., Children],
) -> None:
    queue = broker.queue(unique("inbox-chain"))
    outbox = Outbox()
    committed: list[str] = []
    resume = threading.Event()
    paused = threading.Event()
    relay_killed = threading.Event()
    writer_error: list[BaseException] = []

    def write() -> None:
        try:
            with psycopg.connect(orders_dsn) as conn:
                for n in range(TRANSACTIONS):
                    if n == PAUSE_AT:
                        paused.set()
                        assert resume.wait(120), "the test never let the writer go on"
                    if n == HOLD_AT:
                        assert relay_killed.wait(120), "the test never killed the relay"
                    order_id = f"o{n:05d}"
                    conn.execute("INSERT INTO orders VALUES (%s, %s)", (order_id, 100 + n))
                    body = json.dumps({"order_id": order_id, "amount": 100 + n}).encode()
                    outbox.add(conn, "", queue, body, message_id=f"order-{order_id}")
                    if n % 5 == 4:
                        conn.rollback()  # the order and its message go together
                    else:
                        conn.commit()
                        committed.append(order_id)
        except BaseException as exc:
            writer_error.append(exc)
            raise

    consumer = children(queue, billing_db, mode="chain", prefetch=50)
    consumer.start()
    consumer.wait(lambda r: r.subscribed == 1, 60, "the consumer subscribed")
    relays = [_relay(orders_dsn, amqp_url, "relay-1")]
    writer = threading.Thread(target=write, name="test-writer")
    writer.start()
    try:
        # 1. the relay is killed -9 while it publishes, the writer still writing
        assert paused.wait(120), writer_error
        consumer.wait(lambda r: len(r.handled) >= 100, 120, "100 orders relayed and handled")
        resume.set()
        consumer.wait(lambda r: len(r.handled) >= 200, 120, "200 orders relayed and handled")
        os.kill(relays[0].pid, signal.SIGKILL)
        assert relays[0].wait(30) == -signal.SIGKILL
        written_at_relay_kill = len(committed)
        pending_at_relay_kill = status(orders_dsn).pending
        relays.append(_relay(orders_dsn, amqp_url, "relay-2"))
        relay_killed.set()
        # 2. the consumer is killed -9 mid-run
        consumer.wait(lambda r: len(r.handled) >= 600, 180, "600 deliveries handled")
        consumer.kill9()
        paid_at_consumer_kill = _paid(billing_db.dsn)
        assert len(paid_at_consumer_kill) < COMMITTED, "the consumer's kill came after the run"
        consumer.start()
        writer.join(120)
        assert not writer.is_alive() and not writer_error, writer_error
        assert len(committed) == COMMITTED
        wait_until(lambda: status(orders_dsn).pending == 0, 120, "every order relayed")
        wait_until(lambda: len(_paid(billing_db.dsn)) >= COMMITTED, 120, "every order paid")
        wait_until(lambda: broker.count(queue) == 0, 60, "the queue empty")
        assert consumer.terminate() == 0, consumer.errors()
        relays[-1].send_signal(signal.SIGTERM)
        assert relays[-1].wait(60) == 0, relays[-1].stderr.read() if relays[-1].stderr else ""
    finally:
        resume.set()
        relay_killed.set()
        for relay in relays:
            if relay.poll() is None:
                relay.kill()
                relay.wait(30)
        writer.join(60)
    # what was given back when the last consumer stopped (prefetched, never started) can only
    # be copies of orders already paid: the relay republished what the kill left unconfirmed
    left = [props.message_id for props, _ in broker.drain(queue)]
    assert set(left) <= {f"order-{o}" for o in committed}, left
    paid = _paid(billing_db.dsn)
    assert Counter(paid) == dict.fromkeys(committed, 1)  # exactly the committed, once each
    with psycopg.connect(billing_db.dsn) as conn:
        outgoing = [r[0] for r in conn.execute("SELECT message_id FROM amqp_outbox")]
        claims = conn.execute("SELECT count(*) FROM amqp_inbox").fetchone()
    assert len(outgoing) == COMMITTED
    assert sorted(outgoing) == sorted(f"payment-{o}" for o in committed)
    assert claims == (COMMITTED,)
    record = consumer.record()
    handled = Counter(m for m, _, _, _ in record.handled)
    print(
        f"relay killed with {written_at_relay_kill} orders committed and "
        f"{pending_at_relay_kill} rows pending; consumer killed with "
        f"{len(paid_at_consumer_kill)} of {COMMITTED} paid; {sum(handled.values())} handler "
        f"calls returned for {len(handled)} ids; {len(left)} copies left at the stop"
    )


def _paid(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT order_id FROM payments")]
