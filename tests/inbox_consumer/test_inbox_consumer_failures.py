"""Issue 40 at the consumer's level, when things fail: a handler that fails after claiming is
retried and takes effect once; a message that kills the process every time, on a classic queue,
is dead-lettered after ``max_attempts`` through the inbox's attempts ledger (the ``attempts``
option) while the rest are handled once (both on PostgreSQL, MariaDB and SQLite); a delivery
without ``message_id`` is refused loudly, retried, then dead-lettered, and never handled as
new."""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest

from reliable_amqp import Consumer, Delivery, MissingMessageId
from reliable_amqp.inbox import Inbox
from support.broker import BrokerAdmin, unique
from support.consumer import (
    QUICK,
    QUICK_CONFIG,
    delete_queues,
    drain_all,
    fill,
    ready_count,
    running,
    side_queues,
)
from support.inbox import Database, fetch, run
from support.inbox_consumer import Children, wait_until

pytestmark = [pytest.mark.broker]


@pytest.fixture
def consumers(amqp_url: str) -> Iterator[Callable[..., Consumer]]:
    """Consumers run on a thread of the test; the queues they declared deleted after."""
    queues: list[str] = []

    def make(queue: str, **options: Any) -> Consumer:
        options.setdefault("redelivery", QUICK)
        queues.append(queue)
        return Consumer(amqp_url, queue, **options)

    yield make
    for queue in queues:
        delete_queues(amqp_url, side_queues(queue, QUICK))


# --- rollback ---------------------------------------------------------------------------------

ROLLBACK_COUNT = 150


def test_a_handler_that_fails_after_claiming_is_retried_and_takes_effect_once(
    any_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    consumers: Callable[..., Consumer],
) -> None:
    queue = broker.queue(unique("inbox-rollback"))
    ids = [f"f{i:04d}" for i in range(ROLLBACK_COUNT)]
    fill(amqp_url, queue, ids)
    conn = any_db.connect()
    inbox = Inbox("billing")
    calls: list[tuple[str, int, bool]] = []  # (id, attempt, claim visible in the transaction)

    def handle(delivery: Delivery, conn: Any) -> None:
        run(
            conn,
            "INSERT INTO effects (message_id, note) VALUES (%s, %s)",
            (delivery.message_id, f"attempt {delivery.attempt}"),
        )
        (claimed,) = fetch(
            conn,
            f"SELECT count(*) FROM {inbox.table} WHERE scope = %s AND message_id = %s",
            (inbox.scope, delivery.message_id),
        )[0]
        calls.append((str(delivery.message_id), delivery.attempt, claimed == 1))
        if delivery.attempt == 1:
            raise RuntimeError("failed after claiming and writing")  # rolls both back

    consumer = consumers(queue, prefetch=20)
    with running(consumer, inbox.handler(lambda: _kept(conn), handle)):
        wait_until(lambda: consumer.stats.handled == ROLLBACK_COUNT, 120, "every id handled")
    try:
        effects = any_db.effects(conn)
        notes = fetch(conn, "SELECT DISTINCT note FROM effects")
        claims = fetch(conn, f"SELECT count(*) FROM {inbox.table}")[0][0]
        conn.commit()
    finally:
        conn.close()
    # each id: called on attempt 1 (claimed, then failed), retried, called again on attempt 2
    # (the claim had rolled back with the work, so it was new again), committed once
    assert Counter(m for m, _, _ in calls) == dict.fromkeys(ids, 2)
    assert sorted((a, seen) for _, a, seen in calls) == sorted(
        [(1, True)] * ROLLBACK_COUNT + [(2, True)] * ROLLBACK_COUNT
    )
    assert Counter(effects) == dict.fromkeys(ids, 1)
    assert notes == [("attempt 2",)]  # the first attempt's write rolled back with its claim
    assert claims == ROLLBACK_COUNT
    assert consumer.stats.retried == ROLLBACK_COUNT
    assert consumer.stats.dead_lettered == 0
    assert broker.count(queue) == 0 and broker.count(f"{queue}.dead") == 0


def _kept(conn: Any) -> Any:
    """The test's connection, kept open by the handler between messages."""
    return contextlib.nullcontext(conn)


# --- no message_id ----------------------------------------------------------------------------


def test_a_delivery_without_message_id_is_refused_and_dead_lettered_at_once(
    pg_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    consumers: Callable[..., Consumer],
) -> None:
    queue = broker.queue(unique("inbox-noid"))
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for i in range(3):  # no message_id at all (pika sets none)
            channel.basic_publish("", queue, f"anonymous {i}".encode())
    finally:
        connection.close()
    ids = [f"n{i}" for i in range(5)]
    fill(amqp_url, queue, ids)  # beside them, messages with ids
    conn = pg_db.connect()
    inbox = Inbox("billing")
    handled: list[bytes] = []
    failures: list[BaseException] = []

    def handle(delivery: Delivery, conn: Any) -> None:
        handled.append(delivery.body)
        run(conn, "INSERT INTO effects (message_id, note) VALUES (%s, 'x')", (delivery.message_id,))

    inbox_handler = inbox.handler(lambda: _kept(conn), handle)

    def handler(delivery: Delivery) -> None:
        try:
            inbox_handler(delivery)
        except Exception as exc:
            failures.append(exc)
            raise

    consumer = consumers(queue, prefetch=10)
    dead = f"{queue}.dead"
    with running(consumer, handler):
        # each message without an id refused once and dead-lettered at once (MissingMessageId
        # can never succeed: no retries), the others handled
        wait_until(
            lambda: consumer.stats.dead_lettered + consumer.stats.handled == 3 + len(ids),
            60,
            "every message handled or dead-lettered",
        )
    try:
        effects = pg_db.effects(conn)
        claims = fetch(conn, f"SELECT count(*) FROM {inbox.table}")[0][0]
        conn.commit()
    finally:
        conn.close()
    # refused loudly, once each: the handle never ran for them, nothing was claimed for them
    assert len(failures) == 3
    assert consumer.stats.retried == 0
    assert all(isinstance(e, MissingMessageId) for e in failures), failures
    assert "message_id" in str(failures[0])
    assert sorted(handled) == sorted(i.encode() for i in ids)
    assert effects == sorted(ids) and claims == len(ids)
    letters = drain_all(amqp_url, dead)
    assert sorted(body for _, body in letters) == [f"anonymous {i}".encode() for i in range(3)]
    for props, _ in letters:
        # on the wire every copy has an id (the publisher gives one), marked as not the
        # message's: the consumer's decoder (and dead-letters --requeue) read it as absent
        assert props.headers["x-consume-no-message-id"] is True
        assert props.headers["x-exception-type"] == "reliable_amqp.MissingMessageId"
        assert props.headers["x-attempts"] == 1
    assert broker.count(queue) == 0


# --- crash loop on a classic queue ------------------------------------------------------------

CRASH_COUNT = 30


@pytest.mark.faults
def test_crash_loop_on_a_classic_queue_is_dead_lettered_through_the_attempts_ledger(
    any_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    children: Callable[..., Children],
) -> None:
    """The poison's handler SIGKILLs the process inside its open transaction, every time; a
    supervisor restarts the consumer. A classic queue only says "redelivered": the attempts
    ledger (``attempts=lambda d: inbox.record_attempt(connect, d)``, committed on a connection
    of its own) counts the crashes, and past ``max_attempts`` the message goes to the dead
    letters without another handler call."""
    queue = broker.queue(unique("inbox-crash"))  # classic
    ids = [f"c{i:02d}" for i in range(CRASH_COUNT)]
    poison = ids[5]
    fill(amqp_url, queue, ids)
    group = children(queue, any_db, prefetch=10, crash_on=poison, ledger=True)
    max_attempts = QUICK_CONFIG["max_attempts"]
    others = set(ids) - {poison}
    dead = f"{queue}.dead"
    deaths = 0
    deadline = time.monotonic() + 90
    proc = group.start()
    while True:  # a supervisor: restart the consumer each time it dies
        handled = others & set(group.record().handled_ids())
        settled = ready_count(amqp_url, dead) == 1 and ready_count(amqp_url, queue) == 0
        if handled == others and settled:
            break
        if proc.poll() is not None:
            assert proc.returncode == -signal.SIGKILL, (proc.returncode, group.errors())
            deaths += 1
            assert deaths <= max_attempts + 2, f"still dying after {deaths} restarts"
            proc = group.start()
        assert time.monotonic() < deadline, f"the crash loop did not settle: {deaths} deaths"
        time.sleep(0.05)
    assert group.terminate() == 0, group.errors()
    record = group.record()
    letters = drain_all(amqp_url, dead)
    assert [props.message_id for props, _ in letters] == [poison]
    headers = letters[0][0].headers
    assert headers["x-exception-type"] == "AttemptsExceeded", headers
    assert headers["x-attempts"] == max_attempts + 1
    assert headers["x-original-queue"] == queue
    assert deaths == max_attempts
    assert record.started_ids()[poison] == max_attempts  # then dead without another call
    assert record.handled_ids()[poison] == 0
    assert ready_count(amqp_url, queue) == 0
    conn = any_db.connect()
    try:
        effects = Counter(any_db.effects(conn))
        ledger = [  # MariaDB's varbinary keys come back as bytes
            tuple(v.decode() if isinstance(v, (bytes, bytearray)) else v for v in row)
            for row in fetch(
                conn, "SELECT message_id, attempt, redeliveries FROM amqp_inbox_attempts"
            )
        ]
        claims = fetch(conn, "SELECT count(*) FROM amqp_inbox")[0][0]
        conn.commit()
    finally:
        conn.close()
    assert effects == dict.fromkeys(others, 1)  # the rest handled exactly once
    # the ledger keeps only the message still in trouble: the others' rows were deleted in
    # the transaction that handled them (the poison's go with prune())
    assert ledger == [(poison, 1, max_attempts)], ledger
    assert claims == len(others)
