"""AsyncPublisher when connections break: republished, never lost, and counted.

The TCP proxy of tests/harness sits between the publisher and the broker and cuts or refuses
connections; the disposable broker node is killed and restarted. Every test checks that each
message confirmed to the caller is in the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aio_pika
import pytest
from aio_support import aio, in_thread, outcomes

from conftest import BrokerAdmin
from harness.fixtures import ProxyFactory
from harness.node import DisposableBroker
from reliable_amqp import Confirmation, RecoveryFailed, RetryPolicy
from reliable_amqp._async import AsyncPublisher

pytestmark = [pytest.mark.broker, pytest.mark.faults]

QUICK_RECONNECT = RetryPolicy(max_attempts=50, initial_delay=0.05, max_delay=0.5, jitter=0.0)


async def publish_while(
    publisher: AsyncPublisher, queue: str, n: int, fault: Callable[[], object], at: int
) -> list[asyncio.Future[Confirmation]]:
    """Publish ``n`` messages or more; after the ``at``-th, run the blocking ``fault()``.

    While the fault runs (in a thread) publishing goes on at a steady pace, so the fault finds
    messages written but not confirmed whenever it strikes.
    """
    futures: list[asyncio.Future[Confirmation]] = []

    async def one() -> None:
        futures.append(await publisher.publish("", queue, b"%05d" % len(futures)))

    while len(futures) < at:
        await one()
    injected = asyncio.ensure_future(in_thread(fault))
    while not injected.done():
        await one()
        await asyncio.sleep(0.002)
    await injected
    while len(futures) < n:
        await one()
    return futures


def assert_all_delivered(
    broker: BrokerAdmin, queue: str, futures: list[asyncio.Future[Confirmation]]
) -> None:
    bodies = {body for _, body in broker.drain(queue)}
    assert bodies == {b"%05d" % i for i in range(len(futures))}  # duplicates allowed, losses not


@aio
async def test_cut_connection_is_recovered_and_republished(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy(5672)
    n = 5000
    async with AsyncPublisher(proxy.url(), connect_policy=QUICK_RECONNECT) as publisher:
        futures = await publish_while(publisher, queue, n, proxy.cut, at=2000)
        assert await publisher.flush(timeout=60) == 0
    assert await outcomes(futures) == {"Confirmation": len(futures)}
    assert max(f.result().attempts for f in futures) >= 2  # some went out twice
    assert proxy.accepted_count >= 2
    assert_all_delivered(broker, queue, futures)


@aio
async def test_cut_during_connect_is_retried(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy(5672)
    proxy.refuse()
    publisher = AsyncPublisher(proxy.url(), connect_policy=QUICK_RECONNECT)
    connecting = asyncio.create_task(publisher.connect())
    await asyncio.sleep(0.5)
    assert not connecting.done()
    proxy.accept()
    await asyncio.wait_for(connecting, 10)
    assert (await publisher.publish_and_wait("", queue, b"x")).attempts == 1
    await publisher.aclose()
    assert proxy.accepted_count >= 2


@aio
async def test_connect_policy_spent_fails_loudly(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    proxy = make_proxy(5672)
    proxy.refuse()
    short = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02, jitter=0.0)
    publisher = AsyncPublisher(proxy.url(), connect_policy=short)
    with pytest.raises(RecoveryFailed, match="3 attempts"):
        await publisher.connect()
    await publisher.aclose()


@aio
async def test_lent_robust_connection_recovers_and_republishes(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    # aio-pika's RobustConnection would reject these confirm futures; ours republishes them.
    queue = broker.queue()
    proxy = make_proxy(5672)
    connection = await aio_pika.connect_robust(proxy.url(), reconnect_interval=0.1)
    n = 3000
    try:
        async with AsyncPublisher.from_connection(connection) as publisher:
            futures = await publish_while(publisher, queue, n, proxy.cut, at=1000)
            assert await publisher.flush(timeout=60) == 0
        assert await outcomes(futures) == {"Confirmation": len(futures)}
        assert max(f.result().attempts for f in futures) >= 2  # some went out twice
        assert not connection.is_closed
    finally:
        await connection.close()
    assert_all_delivered(broker, queue, futures)


@aio
async def test_lost_plain_lent_connection_ends_the_publisher(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy(5672)
    connection = await aio_pika.connect(proxy.url())
    publisher = await AsyncPublisher.from_connection(connection).connect()
    proxy.stall()
    futures = [await publisher.publish("", queue, b"%d" % i) for i in range(10)]
    proxy.cut()
    proxy.resume()
    counts = await outcomes(futures, timeout=10)
    assert counts == {"PublisherClosed": 10}  # failed loudly, not dropped
    assert "does not reconnect" in str(futures[0].exception())
    await publisher.aclose()
    await connection.close()


@pytest.mark.slow
@aio
async def test_broker_killed_and_restarted(disposable_broker: DisposableBroker) -> None:
    # kill -9: only what the broker confirmed is on its disk; the rest must be republished.
    url = disposable_broker.url
    admin = BrokerAdmin(url)
    queue = admin.queue()
    admin._conn.close()  # a connection the kill would break anyway; the queue stays declared
    n = 3000
    policy = RetryPolicy(max_attempts=200, initial_delay=0.2, max_delay=1.0, jitter=0.0)

    def kill_and_start() -> None:
        disposable_broker.kill()
        disposable_broker.start()

    async with AsyncPublisher(url, connect_policy=policy, delivery_timeout=120) as publisher:
        futures = await publish_while(publisher, queue, n, kill_and_start, at=1500)
        assert await publisher.flush(timeout=120) == 0
    assert await outcomes(futures) == {"Confirmation": len(futures)}
    assert max(f.result().attempts for f in futures) >= 2
    admin = BrokerAdmin(url)
    admin._queues.append(queue)  # deleted on close
    try:
        assert_all_delivered(admin, queue, futures)
    finally:
        admin.close()


@aio
async def test_fails_over_to_the_next_url(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    dead = make_proxy(5672)
    dead.refuse()
    async with AsyncPublisher([dead.url(), amqp_url], connect_policy=QUICK_RECONNECT) as publisher:
        assert (await publisher.publish_and_wait("", queue, b"x")).attempts == 1
    assert dead.accepted_count >= 1
    assert broker.count(queue) == 1


@pytest.mark.slow
@aio
async def test_declared_topology_is_replayed_after_a_restart(
    disposable_broker: DisposableBroker,
) -> None:
    # A non-durable queue is gone after a broker restart; the publisher declares it again
    # before it republishes, so what it confirms afterwards really is in the queue.
    url = disposable_broker.url
    queue = f"ra-test-async-replay-{id(disposable_broker):x}"
    policy = RetryPolicy(max_attempts=200, initial_delay=0.2, max_delay=1.0, jitter=0.0)
    async with AsyncPublisher(url, connect_policy=policy) as publisher:
        await publisher.declare_queue(queue, durable=False)
        assert (await publisher.publish_and_wait("", queue, b"before")).attempts == 1
        await in_thread(disposable_broker.restart)
        after = [await publisher.publish("", queue, b"after %d" % i) for i in range(100)]
        assert await publisher.flush(timeout=60) == 0
    assert await outcomes(after) == {"Confirmation": 100}
    admin = BrokerAdmin(url)
    admin._queues.append(queue)  # deleted on close
    try:
        bodies = [body for _, body in admin.drain(queue)]
        assert bodies == [b"after %d" % i for i in range(100)]  # "before" died with the node
    finally:
        admin.close()
