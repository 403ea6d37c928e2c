"""AsyncPublisher when connections break: republished, never lost, and counted.

The TCP proxy of tests/harness sits between the publisher and the broker and cuts or refuses
connections; the disposable broker node is killed and restarted. Every test checks that each
message confirmed to the caller is in the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest

from harness.fixtures import ProxyFactory
from harness.node import DisposableBroker
from reliable_amqp import (
    Confirmation,
    EventKind,
    PublisherEvent,
    RecoveryFailed,
    RetryPolicy,
    State,
)
from reliable_amqp._async import AsyncPublisher, _topology
from support.aio import aio, in_thread, outcomes
from support.broker import BrokerAdmin, unique

pytestmark = [pytest.mark.broker, pytest.mark.faults]

QUICK_RECONNECT = RetryPolicy(max_attempts=50, initial_delay=0.05, max_delay=0.5, jitter=0.0)
PATIENT = RetryPolicy(max_attempts=None, initial_delay=0.1, max_delay=1.0, deadline=90.0)


class Events:
    """Collects publisher events (the hook runs on the event loop); ``wait_for`` polls."""

    def __init__(self) -> None:
        self.seen: list[PublisherEvent] = []

    def __call__(self, event: PublisherEvent) -> None:
        self.seen.append(event)

    def count(self, kind: EventKind) -> int:
        return sum(1 for e in self.seen if e.kind is kind)

    async def wait_for(self, kind: EventKind, n: int = 1, timeout: float = 60) -> None:
        end = asyncio.get_running_loop().time() + timeout
        while self.count(kind) < n:
            assert asyncio.get_running_loop().time() < end, (
                f"no {kind.value} event #{n} within {timeout} s: {self.seen}"
            )
            await asyncio.sleep(0.01)


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
    proxy = make_proxy()
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
    proxy = make_proxy()
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
    proxy = make_proxy()
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
    proxy = make_proxy()
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
    proxy = make_proxy()
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
    dead = make_proxy()
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


@aio
async def test_a_connection_closed_under_the_topology_replay_is_only_a_lost_connection(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiormq fails the RPCs of a connection it closed with asyncio.CancelledError. One that
    comes out of the replay of declared topology on a new connection (the broker dropped it
    there) is a lost connection: the publisher tries the next one and goes on. It ended the
    connection task as if cancelled, and the publisher confirmed nothing more. The replay here
    closes its connection and raises as aiormq does, once."""
    queue = unique("replay-cut")
    proxy = make_proxy()
    replays: list[bool] = []

    async def replay(connection: Any, ops: Any, timeout: float) -> None:
        replays.append(True)
        if len(replays) == 1:
            await connection.close()
            raise asyncio.CancelledError  # (what aiormq raises into a closed connection's RPC)
        await real_replay(connection, ops, timeout)

    real_replay = _topology.replay
    monkeypatch.setattr(_topology, "replay", replay)
    try:
        async with AsyncPublisher(proxy.url(), connect_policy=QUICK_RECONNECT) as publisher:
            await publisher.declare_queue(queue, durable=False)
            assert (await publisher.publish_and_wait("", queue, b"before")).attempts == 1
            proxy.cut()
            confirmation = await asyncio.wait_for(
                publisher.publish_and_wait("", queue, b"after"), 30
            )
            assert confirmation.attempts >= 1
            assert publisher.state is State.OPEN
        assert len(replays) == 2  # the one that failed, then the next connection's
        assert sorted(body for _, body in broker.drain(queue)) == [b"after", b"before"]
    finally:
        broker._queues.append(queue)  # deleted with the broker fixture


@aio
async def test_five_cuts_during_one_stream_events_and_stats(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    events = Events()
    n = 20_000
    async with AsyncPublisher(
        proxy.url(), max_in_flight=2000, connect_policy=PATIENT, on_event=events
    ) as publisher:

        async def produce() -> list[asyncio.Future[Confirmation]]:
            return [await publisher.publish("", queue, b"%05d" % i) for i in range(n)]

        producer = asyncio.ensure_future(produce())
        for cut in range(1, 6):
            while publisher.stats().confirmed < cut * 3000:
                await asyncio.sleep(0.005)
            await in_thread(proxy.cut)
            await events.wait_for(EventKind.RECOVERED, n=cut)
        futures = await producer
        assert await publisher.flush(timeout=60) == 0
        stats = publisher.stats()
    assert [e.kind for e in events.seen][:1] == [EventKind.CONNECTED]
    assert events.count(EventKind.CONNECTION_LOST) == 5
    assert events.count(EventKind.CLOSED) == 1
    recovered = [e for e in events.seen if e.kind is EventKind.RECOVERED]
    assert all(e.downtime is not None and e.downtime >= 0 for e in recovered)
    assert stats.published == stats.confirmed == n
    assert stats.recoveries == 5 and stats.republished > 0
    assert stats.latency is not None and stats.latency.count > 0
    assert await outcomes(futures) == {"Confirmation": n}
    assert_all_delivered(broker, queue, futures)


@aio
async def test_channel_loss_is_an_event_and_recovers(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    events = Events()
    async with AsyncPublisher(amqp_url, on_event=events) as publisher:
        bad = await publisher.publish(unique("no-such-exchange"), "rk", b"x")
        assert await publisher.flush(timeout=10) == 0
        assert bad.exception() is not None
        assert (await publisher.publish_and_wait("", queue, b"after")).attempts == 1
        stats = publisher.stats()
    kinds = [e.kind for e in events.seen]
    assert kinds == [
        EventKind.CONNECTED,
        EventKind.CHANNEL_LOST,
        EventKind.RECOVERED,
        EventKind.CLOSED,
    ]
    assert "404" in events.seen[1].detail
    assert stats.rejected == 1 and stats.recoveries == 0  # a channel, not a connection


@aio
async def test_stalled_link_is_detected_by_heartbeat_then_recovered(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    events = Events()
    async with AsyncPublisher(
        proxy.url(), heartbeat=1, connect_policy=PATIENT, connect_timeout=2, on_event=events
    ) as publisher:
        futures = [await publisher.publish("", queue, b"%05d" % i) for i in range(100)]
        assert await publisher.flush(timeout=10) == 0
        await in_thread(proxy.stall)
        stalled_at = time.monotonic()
        futures += [await publisher.publish("", queue, b"%05d" % i) for i in range(100, 200)]
        await events.wait_for(EventKind.CONNECTION_LOST, timeout=20)
        detected = time.monotonic() - stalled_at
        await in_thread(proxy.resume)
        await events.wait_for(EventKind.RECOVERED, timeout=30)
        assert await publisher.flush(timeout=30) == 0
    # aiormq's own watchdog: no frame for 3 x (heartbeat + 1) seconds, checked every second
    assert detected < 9, f"stall noticed only after {detected:.1f} s with heartbeat=1"
    assert await outcomes(futures) == {"Confirmation": 200}
    assert_all_delivered(broker, queue, futures)


@aio
async def test_memory_alarm_pauses_publishing_without_failing(
    disposable_broker: DisposableBroker,
) -> None:
    url = disposable_broker.url
    admin = BrokerAdmin(url)
    queue = admin.queue(unique("alarm"))
    events = Events()
    try:
        async with AsyncPublisher(url, delivery_timeout=60, on_event=events) as publisher:
            assert (await publisher.publish_and_wait("", queue, b"00000")).attempts == 1
            await in_thread(disposable_broker.ctl, "set_vm_memory_high_watermark", "0.0000001")
            await asyncio.sleep(1)  # let the alarm take hold
            futures = [await publisher.publish("", queue, b"%05d" % i) for i in range(1, 500)]
            await events.wait_for(EventKind.BLOCKED, timeout=10)
            assert publisher.state is State.BLOCKED
            await asyncio.sleep(2)
            assert not any(f.done() and f.exception() is not None for f in futures)
            assert publisher.in_flight > 0, "the alarm did not hold anything back"
            await in_thread(disposable_broker.reset_limits)
            await events.wait_for(EventKind.UNBLOCKED, timeout=30)
            assert await publisher.flush(timeout=30) == 0
        assert await outcomes(futures) == {"Confirmation": 499}
        assert admin.count(queue) == 500
    finally:
        admin.close()
