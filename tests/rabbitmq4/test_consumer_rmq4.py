"""The Consumer on RabbitMQ 4 (issue 39): its quorum queues count deliveries by other rules.

From 4.0 a quorum queue has a delivery limit (20) and drops a message past it unless it has a
dead-letter target; from 4.3 ``basic.nack`` no longer raises ``x-delivery-count`` while a lost
connection still does, and ``consumer_timeout`` is enforced by quorum queues only, which cancel
the consumer (``basic.cancel``) instead of closing its channel. A disposable RabbitMQ 4 node
(``scripts/rabbitmq4.sh``'s root, :class:`harness.rabbitmq4.Rabbitmq4Node`: the directory's,
tests/rabbitmq4/conftest.py) serves the module; the consumer runs in a child process for the
crash loop (see tests/consumer). About 25 s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.rabbitmq4 import Rabbitmq4Node
from reliable_amqp import Consumer, Delivery
from reliable_amqp._consume._io import ConsumerIO
from support.broker import BrokerAdmin, unique
from support.consumer import (
    QUICK,
    ChildConsumer,
    check_crash_loop,
    child_factories,
    delete_queues,
    fill,
    running,
    side_queues,
    wait_until,
    warnings_logged,
)

pytestmark = [
    pytest.mark.broker,
    pytest.mark.faults,
    pytest.mark.rabbitmq_only(reason="runs a RabbitMQ 4 node of its own (scripts/rabbitmq4.sh)"),
]


@pytest.fixture
def admin(rmq4: Rabbitmq4Node) -> Iterator[BrokerAdmin]:
    admin = BrokerAdmin(rmq4.url)
    yield admin
    admin.close()


@pytest.fixture
def child_factory(tmp_path: Path) -> Iterator[Callable[..., ChildConsumer]]:
    """``child_factory(url, queue, **config)``: child consumers, killed and cleaned up after."""
    yield from child_factories(tmp_path)


def test_crash_loop_on_a_rabbitmq4_quorum_queue_ends_dead_lettered(
    rmq4: Rabbitmq4Node, admin: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    """The lost connection of each crash raises x-delivery-count (4.3 too): the poison ends in
    ``<queue>.dead`` after max_attempts handler calls, long before the broker's limit of 20."""
    queue = admin.queue(unique("c4-crash"), x_queue_type="quorum")
    check_crash_loop(rmq4.url, queue, child_factory, prefetch=1)


def test_crash_loop_with_a_prefetch_window_on_rabbitmq4_dead_letters_only_the_poison(
    rmq4: Rabbitmq4Node, admin: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    queue = admin.queue(unique("c4-crash"), x_queue_type="quorum")
    check_crash_loop(rmq4.url, queue, child_factory, prefetch=10)


def test_consumer_timeout_on_a_rabbitmq4_quorum_queue_cancels_and_the_consumer_recovers(
    rmq4: Rabbitmq4Node, admin: BrokerAdmin, caplog: pytest.LogCaptureFixture
) -> None:
    """RabbitMQ 4.3 enforces consumer_timeout on quorum queues by cancelling the consumer (a
    per-queue ``x-consumer-timeout`` here): the consumer subscribes again and the message,
    given back by the broker, is handled again; the old channel's late ack is never sent.

    One message and ``prefetch=1`` (no careful start): the slow message is the queue's only
    checkout within the timeout. A message checked out and acked just before it (the careful
    start's "fast" one, as this test had) leaves RabbitMQ 4.3.6 a timer for the acked
    message's deadline; when that timer's evaluation ends within the same millisecond, the
    queue sets no timer for the slow message, which then never times out until some other
    command reaches the queue (8 failures in 45 runs; the queue's state showed the deadline
    9 s past and no timer pending, and a basic.get from elsewhere brought the cancel 3 ms later).
    """
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    url = rmq4.url
    queue = admin.queue(unique("c4-timeout"), x_queue_type="quorum", x_consumer_timeout=2000)
    try:
        fill(url, queue, ["slow"])
        calls: list[tuple[str, bool]] = []
        consumer = Consumer(url, queue, prefetch=1, redelivery=QUICK, handler_timeout=1.0)
        io = consumer._core.io
        assert isinstance(io, ConsumerIO)

        def handler(delivery: Delivery) -> None:
            calls.append((delivery.message_id or "", delivery.redelivered))
            if calls == [("slow", False)]:
                generation = delivery.generation
                wait_until(lambda: io.live_generation > generation, 60, "a new subscription")

        with running(consumer, handler):
            wait_until(lambda: consumer.stats.handled == 2, 90, "the slow message handled again")
            io.flush()
            wait_until(lambda: admin.count(queue) == 0, 10, "the queue empty")
        assert calls == [("slow", False), ("slow", True)], calls
        assert io.recoveries == 1 and io.fatal is None
        assert io.stale_settlements >= 1
        warnings = warnings_logged(caplog)
        assert any("cancelled the consumer" in w for w in warnings), warnings
        assert admin.count(queue) == 0
    finally:
        delete_queues(url, side_queues(queue, QUICK))
