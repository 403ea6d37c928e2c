"""Cancellation and shutdown of AsyncPublisher: nothing is lost track of, every future settles."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from harness.fixtures import ProxyFactory
from reliable_amqp import Confirmation, PublisherClosed, State
from reliable_amqp._async import AsyncPublisher
from support.aio import aio, outcomes
from support.broker import BrokerAdmin

pytestmark = pytest.mark.broker


@aio
async def test_cancelled_waiters_do_not_lose_their_messages(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    async with AsyncPublisher(proxy.url(), heartbeat=0) as publisher:
        proxy.stall()  # nothing confirms while the waiters are cancelled
        tasks = [
            asyncio.create_task(publisher.publish_and_wait("", queue, b"%03d" % i))
            for i in range(100)
        ]
        await asyncio.sleep(0.2)
        assert publisher.in_flight == 100
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert publisher.in_flight == 100  # still tracked
        proxy.resume()
        assert await publisher.flush(timeout=10) == 0
        assert publisher.in_flight == 0
        assert (await publisher.publish_and_wait("", queue, b"after")).attempts == 1
    assert sorted(body for _, body in broker.drain(queue)) == sorted(
        [b"%03d" % i for i in range(100)] + [b"after"]
    )


@aio
async def test_cancelled_future_keeps_its_message_tracked(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    async with AsyncPublisher(amqp_url) as publisher:
        future = await publisher.publish("", queue, b"x")
        future.cancel()
        assert publisher.in_flight == 1
        assert await publisher.flush(timeout=10) == 0
        assert publisher.in_flight == 0
    assert broker.count(queue) == 1


@aio
async def test_cancelling_a_publish_waiting_for_room_takes_nothing(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    async with AsyncPublisher(proxy.url(), max_in_flight=1, heartbeat=0) as publisher:
        proxy.stall()
        first = await publisher.publish("", queue, b"first")
        waiting = [
            asyncio.create_task(publisher.publish("", queue, b"never %d" % i)) for i in range(3)
        ]
        late = asyncio.create_task(publisher.publish("", queue, b"late"))
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in [*waiting, late])
        for task in waiting:  # the ones ahead of "late" give up their turn
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert publisher.in_flight == 1
        proxy.resume()
        assert (await first).attempts == 1
        assert (await (await late)).attempts == 1  # it got the room the cancelled ones left
    assert [body for _, body in broker.drain(queue)] == [b"first", b"late"]


@aio
async def test_aclose_settles_futures_awaited_by_tasks(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    publisher = await AsyncPublisher(proxy.url(), heartbeat=0, max_in_flight=10).connect()
    proxy.stall()
    waiters = [
        asyncio.create_task(publisher.publish_and_wait("", queue, b"%d" % i)) for i in range(30)
    ]
    await asyncio.sleep(0.1)  # 10 in flight, 20 waiting for room
    assert publisher.in_flight == 10
    assert await publisher.aclose(timeout=0.1) == 10
    assert publisher.state is State.CLOSED
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, PublisherClosed) for r in results)
    assert publisher.in_flight == 0
    proxy.resume()


@aio
async def test_cancelling_aclose_still_settles_everything(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    publisher = await AsyncPublisher(proxy.url(), heartbeat=0).connect()
    proxy.stall()
    futures = [await publisher.publish("", queue, b"%d" % i) for i in range(20)]
    closing = asyncio.create_task(publisher.aclose(timeout=30))
    await asyncio.sleep(0.1)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert await outcomes(futures, timeout=1) == {"PublisherClosed": 20}
    proxy.resume()
    with pytest.raises(PublisherClosed):
        await publisher.publish("", queue, b"late")


def test_loop_ending_without_aclose_settles_futures(amqp_url: str, broker: BrokerAdmin) -> None:
    # asyncio.run() cancels the publisher's tasks at the end; that alone settles what was left.
    queue = broker.queue(x_max_length=0, x_overflow="reject-publish")
    held: list[asyncio.Future[Confirmation]] = []

    async def main() -> None:
        publisher = await AsyncPublisher(amqp_url, nack_policy={"max_attempts": 1000}).connect()
        held.extend([await publisher.publish("", queue, b"%d" % i) for i in range(10)])
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert all(f.done() for f in held)
    assert {type(f.exception()).__name__ for f in held} == {"PublisherClosed"}


@aio
async def test_lent_connection_is_left_open(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    connection = await aio_pika.connect(amqp_url)
    try:
        async with AsyncPublisher.from_connection(connection) as publisher:
            futures = [await publisher.publish("", queue, b"%d" % i) for i in range(500)]
            assert await publisher.flush(timeout=10) == 0
        assert await outcomes(futures) == {"Confirmation": 500}
        assert not connection.is_closed
        channel = await connection.channel()  # still usable by its owner
        declared = await channel.declare_queue(queue, passive=True)
        assert declared.declaration_result.message_count == 500
    finally:
        await connection.close()
