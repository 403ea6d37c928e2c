"""Issue 40, "Races", at the consumer's level: two consumer processes at once on one queue of
duplicates (the two copies of each id side by side, so that the broker hands them to the two
consumers together): exactly one effect per id, on PostgreSQL, MariaDB and SQLite; and the same
with the concurrent handlers of one ``AsyncConsumer`` (``AsyncInbox``, asyncpg)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import asyncpg
import psycopg
import pytest

from reliable_amqp import AsyncConsumer, Delivery
from reliable_amqp.inbox import AsyncInbox
from support.broker import BrokerAdmin, unique
from support.consumer import QUICK, delete_queues, side_queues
from support.inbox import Database
from support.inbox_consumer import Children, publish_copies

pytestmark = [pytest.mark.broker]

COUNT = 400


def test_two_consumers_racing_on_duplicates_give_one_effect_per_id(
    any_db: Database,
    amqp_url: str,
    broker: BrokerAdmin,
    children: Callable[..., Children],
) -> None:
    queue = broker.queue(unique("inbox-race"))
    ids = [f"r{i:04d}" for i in range(COUNT)]
    copies = {(m, c) for m in ids for c in "ab"}
    # prefetch 1: the broker deals the queue out one message at a time, alternately
    group = children(queue, any_db, prefetch=1)
    first, second = group.start(), group.start()
    group.wait(lambda r: r.subscribed == 2, 60, "both consumers subscribed")
    publish_copies(amqp_url, queue, ids, lag=0)  # a0 b0 a1 b1 ...: copies dealt to both
    group.wait(lambda r: r.handled_copies() == copies, 180, "every copy handled")
    for proc in (first, second):
        assert group.terminate(proc) == 0, group.errors()
    record = group.record()
    assert broker.count(queue) == 0
    assert broker.count(f"{queue}.dead") == 0
    conn = any_db.connect()
    try:
        effects = Counter(any_db.effects(conn))
    finally:
        conn.close()
    assert set(effects) == set(ids)
    assert max(effects.values()) == 1, [m for m, n in effects.items() if n > 1][:10]
    # both consumers worked, and each skipped copies that the other had claimed
    exits = record.exits
    assert len(exits) == 2 and all(e["claimed"] > 0 and e["duplicates"] > 0 for e in exits), exits
    assert sum(e["claimed"] for e in exits) == COUNT
    raced = record.races()
    print(f"{any_db.dialect}: {raced} ids were in both consumers' handlers at once; {exits}")
    assert raced > 0, "no two copies were ever handled at the same time: the test raced nothing"


ASYNC_COUNT = 300


def test_async_consumer_handlers_racing_on_duplicates_give_one_effect_per_id(
    pg_db: Database, amqp_url: str, broker: BrokerAdmin
) -> None:
    """``AsyncConsumer(concurrency=8)`` with ``AsyncInbox.handler`` on an asyncpg pool: the two
    copies of an id run in two handlers of one loop at once, each in its own transaction on its
    own pooled connection; one effect per id."""
    queue = broker.queue(unique("inbox-arace"))
    ids = [f"a{i:04d}" for i in range(ASYNC_COUNT)]
    publish_copies(amqp_url, queue, ids, lag=0)
    inbox = AsyncInbox("billing")
    consumer = AsyncConsumer(amqp_url, queue, prefetch=16, concurrency=8, redelivery=QUICK)
    in_flight: dict[str, int] = {}
    raced: set[str] = set()
    returned = 0

    async def handle(delivery: Delivery, conn: Any) -> None:
        await conn.execute(
            "INSERT INTO effects (message_id, note) VALUES ($1, $2)",
            delivery.message_id,
            delivery.body.decode(),
        )

    async def main() -> None:
        pool = await asyncpg.create_pool(pg_db.dsn, min_size=8, max_size=8)
        try:
            inbox_handler = inbox.handler(pool.acquire, handle)

            async def handler(delivery: Delivery) -> None:
                nonlocal returned
                message_id = str(delivery.message_id)
                in_flight[message_id] = in_flight.get(message_id, 0) + 1
                if in_flight[message_id] > 1:
                    raced.add(message_id)  # the other copy's transaction is open too
                try:
                    await inbox_handler(delivery)
                finally:
                    in_flight[message_id] -= 1
                returned += 1
                if returned == 2 * ASYNC_COUNT:
                    consumer.stop()  # the running handlers finish and are acked first

            await asyncio.wait_for(consumer.run(handler), 120)
        finally:
            await pool.close()

    try:
        asyncio.run(main())
    finally:
        delete_queues(amqp_url, side_queues(queue, QUICK))
    assert consumer.stats.handled == 2 * ASYNC_COUNT
    assert broker.count(queue) == 0
    with psycopg.connect(pg_db.dsn) as conn:
        effects = Counter(r[0] for r in conn.execute("SELECT message_id FROM effects"))
    assert effects == dict.fromkeys(ids, 1)
    assert (inbox.stats.claimed, inbox.stats.duplicates) == (ASYNC_COUNT, ASYNC_COUNT)
    print(f"{len(raced)} ids were in two handlers at once")
    assert raced, "no two copies were ever handled at the same time: the test raced nothing"
