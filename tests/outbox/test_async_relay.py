"""AsyncOutboxRelay: the same loop as OutboxRelay, as a task of the application's event loop,
publishing through an AsyncPublisher. Against the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import random

import psycopg
import pytest

from reliable_amqp.outbox import AsyncOutbox, AsyncOutboxRelay
from support.broker import BrokerAdmin
from support.outbox import read_ids, wait_for_count

pytestmark = pytest.mark.broker


def test_an_asyncio_service_writes_and_relays_on_one_loop(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    outbox = AsyncOutbox()

    async def main() -> list[str]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await outbox.install(conn)
        relay = AsyncOutboxRelay(pg_dsn, amqp_url, poll_interval=0.5)
        task = asyncio.create_task(relay.run())
        committed: list[str] = []
        rng = random.Random(5)
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            for i in range(300):
                mid = await outbox.add(conn, "", queue, b"%d" % i, key=f"k{i % 7}")
                if rng.random() < 0.25:
                    await conn.rollback()
                else:
                    await conn.commit()
                    committed.append(mid)
        for _ in range(1200):  # the relay deletes each row once confirmed
            stats = relay.stats()
            if stats is not None and stats.confirmed >= len(committed):
                break
            await asyncio.sleep(0.05)
        relay.stop()
        await asyncio.wait_for(task, 60)
        stats = relay.stats()
        assert stats is not None and stats.confirmed == len(committed) and stats.in_flight == 0
        return committed

    committed = asyncio.run(main())
    assert wait_for_count(broker, queue, len(committed), 30) == len(committed)
    assert sorted(mid for mid, _ in read_ids(broker, queue)) == sorted(committed)


def test_cancelling_the_relay_task_settles_what_is_in_flight(
    pg_dsn: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()

    async def main() -> list[str]:
        outbox = AsyncOutbox()
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await outbox.install(conn)
            await conn.commit()
            ids = await outbox.add_many(
                conn, [{"exchange": "", "routing_key": queue, "body": b"x"}] * 2000
            )
            await conn.commit()
        relay = AsyncOutboxRelay(pg_dsn, amqp_url)
        task = asyncio.create_task(relay.run())
        while True:
            stats = relay.stats()
            if stats is not None and stats.published > 0:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = relay.stats()
        assert stats is not None and stats.in_flight == 0  # settled, not abandoned
        return ids

    ids = asyncio.run(main())
    with psycopg.connect(pg_dsn) as conn:
        pending = {r[0] for r in conn.execute("SELECT message_id FROM amqp_outbox").fetchall()}
    delivered = {mid for mid, _ in read_ids(broker, queue)}
    # what was confirmed was deleted; what was not is still pending: nothing lost
    assert delivered | pending == set(ids)
