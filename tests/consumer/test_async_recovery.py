"""AsyncConsumer's event-loop I/O through losses (issue 47), against the real broker.

The sync consumer's recovery tests (``test_consumer_faults.py``) run ``Consumer`` on its I/O
thread; ``AsyncConsumer`` has its own I/O now (``_consume/_aio_io.py``, on the event loop), so
the same faults again: the broker's ``basic.cancel`` (the queue deleted, declared again), links
cut twice mid-run (the connection reset under it), and a link that goes silent (every byte
dropped, nothing closed: only the liveness check notices).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from harness.fixtures import ProxyFactory
from reliable_amqp import AsyncConsumer, Delivery
from reliable_amqp._consume._aio_io import LoopConsumerIO
from support.broker import BrokerAdmin, unique
from support.consumer import QUICK, delete_queues, fill, side_queues, wait_until, warnings_logged

pytestmark = [pytest.mark.broker]


@pytest.fixture
def own_queues(amqp_url: str) -> Iterator[list[str]]:
    """Queues a consumer declared for itself (dead letters, delay levels), deleted after."""
    queues: list[str] = []
    yield queues
    for queue in queues:
        delete_queues(amqp_url, side_queues(queue, QUICK))


@contextlib.contextmanager
def running(
    consumer: AsyncConsumer, handler: Callable[[Delivery], Awaitable[Any]]
) -> Iterator[LoopConsumerIO]:
    """``asyncio.run(consumer.run(handler))`` on a thread for the block (its I/O yielded);
    stopped, and run()'s own error raised, at its end."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(consumer.run(handler))
        except BaseException as exc:
            errors.append(exc)

    io = consumer._core.io
    assert isinstance(io, LoopConsumerIO)
    thread = threading.Thread(target=run, name="test-async-consumer")
    thread.start()
    try:
        yield io
    finally:
        consumer.stop()
        thread.join(60)
    assert not thread.is_alive(), "run() did not return after stop()"
    if errors:
        raise errors[0]


@pytest.mark.rabbitmq_only(
    reason="RabbitMQ's basic.cancel on queue deletion (consumer_cancel_notify)"
)
def test_async_queue_deleted_and_declared_again_consumes_what_arrives_next(
    amqp_url: str,
    broker: BrokerAdmin,
    own_queues: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    queue = broker.queue(unique("c-async-deleted"))
    own_queues.append(queue)
    seen: list[str | None] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id)

    consumer = AsyncConsumer(amqp_url, queue, prefetch=10, concurrency=4, redelivery=QUICK)
    with running(consumer, handler) as io:
        fill(amqp_url, queue, [f"a{i}" for i in range(5)])
        wait_until(lambda: len(seen) == 5, 30, "the first 5 messages handled")
        generation = io.generation
        broker.channel.queue_delete(queue)
        # The broker's basic.cancel: the consumer drops its channel and subscribes again
        wait_until(lambda: io.generation > generation, 30, "a new channel")
        broker.queue(queue)
        fill(amqp_url, queue, [f"b{i}" for i in range(5)])
        wait_until(lambda: len(seen) == 10, 60, "the messages sent after the new declare")
        assert io.consuming.is_set() and io.fatal is None
    assert sorted(seen[:5]) == [f"a{i}" for i in range(5)]  # type: ignore[type-var]
    assert sorted(seen[5:]) == [f"b{i}" for i in range(5)]  # type: ignore[type-var]
    warnings = warnings_logged(caplog)
    assert any("cancelled the consumer" in w for w in warnings), warnings
    assert broker.count(queue) == 0


def test_async_links_cut_twice_mid_run_every_message_handled(
    broker: BrokerAdmin, own_queues: list[str], make_proxy: ProxyFactory
) -> None:
    """Connections reset under a running AsyncConsumer(concurrency=16) twice: it reconnects,
    every message is handled (some twice: at-least-once), nothing is left unacked."""
    queue = broker.queue(unique("c-async-cut"))
    own_queues.append(queue)
    ids = [f"m{i:04d}" for i in range(3000)]
    proxy = make_proxy()
    fill(proxy.url(), queue, ids)
    seen: list[str] = []

    async def handler(delivery: Delivery) -> None:
        await asyncio.sleep(0.0005)
        seen.append(delivery.message_id or "")

    consumer = AsyncConsumer(proxy.url(), queue, prefetch=100, concurrency=16, redelivery=QUICK)
    with running(consumer, handler) as io:
        for cuts, at in enumerate((600, 1500), start=1):

            def handled(at: int = at) -> bool:
                return len(seen) >= at

            def recovered(cuts: int = cuts) -> bool:
                return io.recoveries >= cuts

            wait_until(handled, 60, f"{at} messages handled")
            assert proxy.cut() >= 1
            wait_until(recovered, 60, f"recovery {cuts}")
        wait_until(lambda: set(seen) >= set(ids), 120, "every message handled")
        assert io.fatal is None
    assert len(seen) - len(ids) <= 2 * 100 + 32  # duplicates bounded by what was unacked
    wait_until(lambda: broker.count(queue) == 0, 30, "the queue empty")


def test_async_stalled_link_is_noticed_and_consuming_resumes(
    broker: BrokerAdmin, own_queues: list[str], make_proxy: ProxyFactory
) -> None:
    """A link that drops every byte and closes nothing: two heartbeats of silence (checked on
    a loop timer, the event loop itself running) end it; the consumer reconnects once the link
    is back and loses nothing."""
    queue = broker.queue(unique("c-async-stall"))
    own_queues.append(queue)
    ids = [f"m{i:04d}" for i in range(1000)]
    fill(broker.url, queue, ids)
    proxy = make_proxy()
    go = asyncio.Event()
    seen: list[str] = []
    loop_of_run: list[asyncio.AbstractEventLoop] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id or "")
        if len(seen) == 300:
            loop_of_run.append(asyncio.get_running_loop())
            await go.wait()  # paused (the loop running) while the test stalls the link

    consumer = AsyncConsumer(proxy.url(), queue, prefetch=100, heartbeat=1, redelivery=QUICK)
    with running(consumer, handler) as io:
        try:
            wait_until(lambda: len(seen) >= 300, 60, "300 messages handled")
            stalled = time.monotonic()
            proxy.stall()
            wait_until(lambda: not io.consuming.is_set(), 30, "the liveness check to notice")
            noticed = time.monotonic() - stalled
            proxy.resume()
        finally:
            if loop_of_run:
                loop_of_run[0].call_soon_threadsafe(go.set)
        wait_until(lambda: set(seen) >= set(ids), 60, "every message handled")
        assert io.recoveries >= 1 and io.fatal is None
    # two heartbeats of silence, checked every half heartbeat: 2 to 2.5 s; slack for the load
    assert noticed < 5.5, f"a stalled link was noticed after {noticed:.1f} s"
    wait_until(lambda: broker.count(queue) == 0, 30, "the queue empty")
