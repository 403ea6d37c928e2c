"""The Consumer under faults (issue 39, "What it must show"): each test proves one line of the
contract in docs/consumer.md against a real broker.

The process faults (kill -9, connections closed, SIGTERM, a crash loop) run the consumer in a
child process (``child_consumer.py``) that records each handler call in a file, so kill -9 is
real and the parent counts what was handled. The others (a deleted queue, a long handler,
prefetch, ``consumer_timeout``) kill no process and run the Consumer on a thread of the test.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.fixtures import ProxyFactory
from harness.node import DisposableBroker
from reliable_amqp import Consumer, Delivery, RetryPolicy
from reliable_amqp._consume._io import ConsumerIO
from support.broker import BrokerAdmin, unique
from support.consumer import (
    QUICK,
    ChildConsumer,
    Record,
    check_crash_loop,
    child_factories,
    delete_queues,
    fill,
    running,
    side_queues,
    wait_until,
    warnings_logged,
)

pytestmark = [pytest.mark.broker]


def _handled_at_least(n: int) -> Callable[[Record], bool]:
    """A wait_record predicate: at least ``n`` distinct messages handled."""
    return lambda record: len(record.handled_ids()) >= n


def _calls_at_least(n: int) -> Callable[[Record], bool]:
    """A wait_record predicate: at least ``n`` handler calls."""
    return lambda record: len(record.handled) >= n


@pytest.fixture
def child_factory(tmp_path: Path) -> Iterator[Callable[..., ChildConsumer]]:
    """``child_factory(url, queue, **config)``: child consumers, killed and cleaned up after."""
    yield from child_factories(tmp_path)


# --- kill -9 ---------------------------------------------------------------------------------

KILL_TOTAL = 5000
KILL_PREFETCH = 100


@pytest.mark.slow
@pytest.mark.faults
def test_kill_9_twice_mid_run_every_message_handled_queue_empty(
    amqp_url: str, broker: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    queue = broker.queue(unique("c-kill"))
    ids = [f"m{i:05d}" for i in range(KILL_TOTAL)]
    fill(amqp_url, queue, ids)
    # pace: a handler of ~0.3 ms, so the kills land mid-run on a fast machine too
    child = child_factory(amqp_url, queue, prefetch=KILL_PREFETCH, pace=0.0003)
    for kill_at in (1000, 2500):
        child.start()
        child.wait_record(_handled_at_least(kill_at), 120, f"{kill_at} messages handled")
        child.kill9()
        assert len(child.record().handled_ids()) < KILL_TOTAL, "the kill came after the run"
    child.start()
    child.wait_record(
        lambda r: len(r.handled_ids()) == KILL_TOTAL, 180, "every message handled once at least"
    )
    code, _ = child.terminate()
    assert code == 0, child.errors()
    record = child.record()
    counts = record.handled_ids()
    assert set(counts) == set(ids)
    # Duplicates: only what was handled but not yet acked when each kill landed, at most the
    # prefetch window per kill.
    duplicates = sum(counts.values()) - KILL_TOTAL
    assert duplicates <= 2 * KILL_PREFETCH, duplicates
    assert broker.count(queue) == 0  # the last consumer stopped: nothing unacked came back
    assert record.exits and record.exits[-1]["dead_lettered"] == 0


@pytest.mark.faults
def test_kill_9_during_a_handler_gives_its_message_back(
    amqp_url: str, broker: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    """Ack after the work: the message whose handler was running when the process died is not
    acked, and comes back with the rest of the window (an ack at delivery would lose it)."""
    queue = broker.queue(unique("c-kill1"))
    total, prefetch = 20, 10
    fill(amqp_url, queue, [f"m{i:02d}" for i in range(total)])
    child = child_factory(amqp_url, queue, prefetch=prefetch, slow=60.0)
    child.start()
    child.wait_record(lambda r: bool(r.started), 60, "the first handler call")
    wait_until(lambda: broker.count(queue) <= total - prefetch, 30, "the prefetch window taken")
    child.kill9()
    # The broker requeues a dead connection's unacked messages at once
    wait_until(lambda: broker.count(queue) >= total - 1, 30, "the window back in the queue")
    assert broker.count(queue) == total, "the message of the running handler was acked"
    assert child.record().handled == []


@pytest.mark.slow
@pytest.mark.faults
def test_kill_9_twice_under_async_concurrency_loses_nothing(
    amqp_url: str, broker: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    """The same with AsyncConsumer(concurrency=16), handlers finishing out of order: an ack
    (``multiple``) that covered a message still running would lose it at the kill."""
    queue = broker.queue(unique("c-akill"))
    ids = [f"m{i:05d}" for i in range(KILL_TOTAL)]
    fill(amqp_url, queue, ids)
    child = child_factory(amqp_url, queue, prefetch=KILL_PREFETCH, concurrency=16, pace=0.002)
    for kill_at in (1000, 2500):
        child.start()
        child.wait_record(_handled_at_least(kill_at), 120, f"{kill_at} messages handled")
        child.kill9()
        assert len(child.record().handled_ids()) < KILL_TOTAL, "the kill came after the run"
    child.start()
    child.wait_record(
        lambda r: len(r.handled_ids()) == KILL_TOTAL, 180, "every message handled once at least"
    )
    code, _ = child.terminate()
    assert code == 0, child.errors()
    counts = child.record().handled_ids()
    assert set(counts) == set(ids)
    assert sum(counts.values()) - KILL_TOTAL <= 2 * KILL_PREFETCH
    assert broker.count(queue) == 0


# --- connections closed by the broker ----------------------------------------------------------

CLOSE_TOTAL = 20_000
CLOSE_GATES = (4000, 9000, 14000)


def close_connections(node: DisposableBroker, name: str) -> int:
    """Have the broker close every connection whose client-given name contains ``name`` (the
    consumer's and its redelivery publisher's), as ``rabbitmqctl close_connection`` does; only
    this test's connections, found by name in one call. Returns how many."""
    expr = (
        f'Name = <<"{name}">>, '
        "Pids = [P || P <- rabbit_networking:connections(), begin "
        "Props = proplists:get_value(client_properties, "
        "rabbit_networking:connection_info(P, [client_properties]), []), "
        'case lists:keyfind(<<"connection_name">>, 1, Props) of '
        "{_, longstr, V} -> binary:match(V, Name) =/= nomatch; _ -> false end end], "
        '[rabbit_networking:close_connection(P, "closed by the consumer fault test") '
        "|| P <- Pids], length(Pids)."
    )
    return int(node.erl(expr))


@pytest.mark.slow
@pytest.mark.faults
def test_broker_closes_connections_three_times_every_message_handled(
    disposable_broker: DisposableBroker,
    child_factory: Callable[..., ChildConsumer],
) -> None:
    url = disposable_broker.url
    admin = BrokerAdmin(url)
    try:
        queue = admin.queue(unique("c-close"))
        ids = [f"m{i:05d}" for i in range(CLOSE_TOTAL)]
        fill(url, queue, ids)
        name = unique("conn")
        # The handler pauses at each gate until the test has closed the connections: each close
        # lands mid-run at a known point, however fast or slow the machine.
        child = child_factory(url, queue, prefetch=200, connection_name=name, gates=CLOSE_GATES)
        child.start()
        for gate in CLOSE_GATES:
            child.wait_record(_calls_at_least(gate), 120, f"{gate} handler calls")
            assert close_connections(disposable_broker, name) >= 1
            child.gate(gate)
        child.wait_record(
            lambda r: len(r.handled_ids()) == CLOSE_TOTAL, 180, "every message handled"
        )
        code, _ = child.terminate()
        assert code == 0, child.errors()
        record = child.record()
        assert set(record.handled_ids()) == set(ids)
        # One recovery per close, never a give-up: the consumer subscribed again each time.
        assert record.exits[-1]["recoveries"] == len(CLOSE_GATES), record.exits
        assert "lost its subscription" in child.errors()
        assert admin.count(queue) == 0
    finally:
        admin.close()


# --- SIGTERM during a slow handler --------------------------------------------------------------


@pytest.mark.faults
def test_sigterm_during_slow_handler_acks_it_and_gives_back_the_rest(
    amqp_url: str, broker: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    queue = broker.queue(unique("c-term"))
    total, prefetch = 30, 10
    ids = [f"m{i:02d}" for i in range(total)]
    fill(amqp_url, queue, ids)
    child = child_factory(amqp_url, queue, prefetch=prefetch, slow=2.0)
    child.start()
    child.wait_record(lambda r: bool(r.started), 60, "the first handler call")
    # The broker has handed the consumer its prefetch window by now (ready <= total - prefetch;
    # the window's exact size is test_a_blocked_handler_holds_exactly_prefetch_unacked's).
    wait_until(lambda: broker.count(queue) <= total - prefetch, 30, "the prefetch window taken")
    code, seconds = child.terminate()
    assert code == 0, child.errors()
    assert seconds < 10, f"the consumer took {seconds:.1f} s to exit after SIGTERM"
    record = child.record()
    assert [m for m, _, _ in record.handled] == ["m00"], record.handled  # finished, then stopped
    assert [m for m, _, _ in record.started] == ["m00"], "a second handler started after SIGTERM"
    # m00 was acked: not back in the queue. The 9 prefetched, never started, are back (ready).
    assert broker.count(queue) == total - 1
    left = [props.message_id for props, _ in broker.drain(queue)]
    assert sorted(left) == ids[1:]


# --- crash loop on a quorum queue -------------------------------------------------------------


@pytest.mark.faults
@pytest.mark.rabbitmq_only(
    reason="a quorum queue as declared, counting deliveries: LavinMQ 2.9 declares a classic "
    "queue instead and counts only with x-delivery-limit (the next test)"
)
def test_crash_loop_on_a_quorum_queue_ends_dead_lettered(
    amqp_url: str, broker: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    """prefetch=1: the poison is alone in flight when it kills the process."""
    queue = broker.queue(unique("c-crash"), x_queue_type="quorum")
    check_crash_loop(amqp_url, queue, child_factory, prefetch=1)


@pytest.mark.faults
def test_crash_loop_with_a_prefetch_window_dead_letters_only_the_poison(
    amqp_url: str, broker: BrokerAdmin, child_factory: Callable[..., ChildConsumer]
) -> None:
    """A quorum queue with a delivery limit far above ``max_attempts``: RabbitMQ counts either
    way; LavinMQ (which has no quorum queues: it declares a classic one) adds
    ``x-delivery-count`` only to a queue with ``x-delivery-limit``. So this runs on both."""
    queue = broker.queue(unique("c-crash"), x_queue_type="quorum", x_delivery_limit=100)
    check_crash_loop(amqp_url, queue, child_factory, prefetch=10)


# --- in the test's process: a deleted queue, a long handler, prefetch, consumer_timeout ---------


@pytest.fixture
def own_queues(amqp_url: str) -> Iterator[list[str]]:
    """Queues a consumer declared for itself (dead letters, delay levels), deleted after."""
    queues: list[str] = []
    yield queues
    for queue in queues:
        delete_queues(amqp_url, side_queues(queue, QUICK))


def test_queue_deleted_and_declared_again_consumes_what_arrives_next(
    amqp_url: str,
    broker: BrokerAdmin,
    own_queues: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    queue = broker.queue(unique("c-deleted"))
    own_queues.append(queue)
    seen: list[str | None] = []
    consumer = Consumer(amqp_url, queue, prefetch=10, redelivery=QUICK)
    io = consumer._core.io
    assert isinstance(io, ConsumerIO)
    with running(consumer, lambda d: seen.append(d.message_id)):
        fill(amqp_url, queue, [f"a{i}" for i in range(5)])
        wait_until(lambda: len(seen) == 5, 30, "the first 5 messages handled")
        broker.channel.queue_delete(queue)
        # The broker's basic.cancel: the consumer drops its channel and subscribes again
        wait_until(lambda: not io.consuming.is_set(), 30, "the subscription to end")
        broker.queue(queue)
        fill(amqp_url, queue, [f"b{i}" for i in range(5)])
        wait_until(lambda: len(seen) == 10, 60, "the messages sent after the new declare")
        assert io.consuming.is_set() and io.fatal is None
    assert seen == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)]
    assert any("cancelled the consumer" in w for w in warnings_logged(caplog)), warnings_logged(
        caplog
    )
    assert broker.count(queue) == 0


def test_handler_three_heartbeats_long_is_no_reconnect(
    amqp_url: str,
    broker: BrokerAdmin,
    own_queues: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    queue = broker.queue(unique("c-long"))
    own_queues.append(queue)
    heartbeat, ids = 1, ["long-1", "long-2"]
    fill(amqp_url, queue, ids)
    calls: list[tuple[str, bool]] = []

    def handler(delivery: Delivery) -> None:
        calls.append((delivery.message_id or "", delivery.redelivered))
        time.sleep(3.5 * heartbeat)  # blocks the calling thread: the I/O thread must not care

    consumer = Consumer(amqp_url, queue, prefetch=10, heartbeat=heartbeat, redelivery=QUICK)
    io = consumer._core.io
    assert isinstance(io, ConsumerIO)
    with running(consumer, handler):
        wait_until(lambda: len(calls) == 2 and consumer.stats.handled == 2, 60, "both handled")
        io.flush()
        wait_until(lambda: broker.count(queue) == 0, 10, "the queue empty")
        negotiated = io._connection.params.heartbeat if io._connection else None
    assert negotiated == heartbeat  # the broker took the 1 s heartbeat
    assert calls == [(i, False) for i in ids]  # each once, never redelivered
    assert io.recoveries == 0 and io.generation == 1
    assert not [w for w in warnings_logged(caplog) if "lost its" in w], warnings_logged(caplog)
    assert broker.count(queue) == 0


def test_a_blocked_handler_holds_exactly_prefetch_unacked(
    amqp_url: str, broker: BrokerAdmin, own_queues: list[str]
) -> None:
    queue = broker.queue(unique("c-prefetch"))
    own_queues.append(queue)
    total, prefetch = 50, 7
    ids = [f"m{i:02d}" for i in range(total)]
    fill(amqp_url, queue, ids)
    release = threading.Event()
    seen: list[str] = []

    def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id or "")
        if len(seen) == 1:
            assert release.wait(60)

    consumer = Consumer(amqp_url, queue, prefetch=prefetch, redelivery=QUICK)
    with running(consumer, handler):
        try:
            wait_until(lambda: bool(seen), 30, "the first handler call")
            # total = ready + unacked, and nothing was acked: unacked = total - ready
            wait_until(lambda: len(consumer._queue) >= prefetch - 1, 30, "the prefetch window")
            wait_until(lambda: broker.count(queue) <= total - prefetch, 30, "the window unacked")
            assert total - broker.count(queue) == prefetch
            assert len(consumer._queue) == prefetch - 1  # and no more arrived meanwhile
        finally:
            release.set()
        wait_until(lambda: len(seen) == total, 60, "every message handled")
    assert seen == ids
    assert broker.count(queue) == 0


#: the broker's consumer_timeout on the disposable node for the test (ms), and how often a
#: channel checks it (RabbitMQ 3.x checks on a channel tick, 60 s by default)
TIMEOUT_MS, TICK_MS = 2000, 500


@pytest.mark.faults
@pytest.mark.rabbitmq_only(reason="sets consumer_timeout on the node through DisposableBroker.erl")
def test_consumer_timeout_closes_the_channel_and_the_consumer_recovers(
    disposable_broker: DisposableBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    node = disposable_broker
    url = node.url
    admin = BrokerAdmin(url)
    queue = admin.queue(unique("c-timeout"))
    node.erl(
        f"application:set_env(rabbit, consumer_timeout, {TIMEOUT_MS}), "
        f"application:set_env(rabbit, channel_tick_interval, {TICK_MS}).",
    )
    try:
        fill(url, queue, ["slow"])
        calls: list[tuple[int, bool]] = []
        consumer = Consumer(url, queue, prefetch=5, redelivery=QUICK, handler_timeout=1.0)
        io = consumer._core.io
        assert isinstance(io, ConsumerIO)

        def handler(delivery: Delivery) -> None:
            calls.append((delivery.attempt, delivery.redelivered))
            if len(calls) == 1:
                # A sync handler past the broker's consumer_timeout: it returns only once the
                # broker closed the channel and the consumer opened a new one.
                generation = delivery.generation
                wait_until(lambda: io.live_generation > generation, 30, "a new channel")

        with running(consumer, handler):
            wait_until(lambda: consumer.stats.handled == 2, 60, "the message handled again")
            io.flush()
            wait_until(lambda: admin.count(queue) == 0, 10, "the queue empty")
        assert calls == [(1, False), (2, True)]  # handled again after the broker's requeue
        assert io.recoveries == 1 and io.fatal is None
        assert io.stale_settlements >= 1  # the late ack of the old channel was never sent
        warnings = warnings_logged(caplog)
        assert any("lost its channel" in w and "timed out" in w for w in warnings), warnings
        assert len([w for w in warnings if "handler_timeout" in w]) == 1, warnings
        assert admin.count(queue) == 0
    finally:
        node.erl(
            "application:set_env(rabbit, consumer_timeout, 1800000), "
            "application:set_env(rabbit, channel_tick_interval, 60000).",
        )
        delete_queues(url, side_queues(queue, QUICK))
        admin.close()


@pytest.mark.rabbitmq_only(reason="a quorum queue and its x-delivery-count")
def test_a_fresh_start_on_a_quorum_queue_charges_no_delivery_it_never_had(
    amqp_url: str, broker: BrokerAdmin, own_queues: list[str]
) -> None:
    """The careful start's switch to the full prefetch must not make the broker give a message
    back: on a quorum queue that is a delivery charged (x-delivery-count), and with
    max_attempts=1 a message dead-lettered without its handler ever running."""
    queue = broker.queue(unique("c-fresh"), x_queue_type="quorum")
    own_queues.append(queue)
    ids = [f"m{i:02d}" for i in range(20)]
    fill(amqp_url, queue, ids)
    once = RetryPolicy(max_attempts=1)
    calls: list[tuple[str, int, bool]] = []
    consumer = Consumer(amqp_url, queue, prefetch=5, redelivery=once)
    with running(consumer, lambda d: calls.append((d.message_id or "", d.attempt, d.redelivered))):
        wait_until(
            lambda: len(calls) + consumer.stats.dead_lettered >= len(ids), 30, "every message"
        )
    assert consumer.stats.dead_lettered == 0, "dead-lettered without a handler call"
    assert calls == [(m, 1, False) for m in ids]
    assert consumer.stats.dead_lettered == 0 and broker.count(f"{queue}.dead") == 0
    assert broker.count(queue) == 0


@pytest.mark.faults
def test_a_stalled_link_is_noticed_by_heartbeats_and_consuming_resumes(
    amqp_url: str, broker: BrokerAdmin, own_queues: list[str], make_proxy: ProxyFactory
) -> None:
    """A link that drops every byte and closes nothing (a frozen node, a partition): only the
    heartbeats notice; the consumer reconnects once the link is back and loses nothing."""
    queue = broker.queue(unique("c-stall"))
    own_queues.append(queue)
    ids = [f"m{i:04d}" for i in range(2000)]
    fill(amqp_url, queue, ids)
    proxy = make_proxy()
    go = threading.Event()
    seen: list[str] = []

    def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id or "")
        if len(seen) == 500:
            assert go.wait(60)  # paused while the test stalls the link

    consumer = Consumer(proxy.url(), queue, prefetch=100, heartbeat=1, redelivery=QUICK)
    io = consumer._core.io
    assert isinstance(io, ConsumerIO)
    with running(consumer, handler):
        try:
            wait_until(lambda: len(seen) >= 500, 60, "500 messages handled")
            stalled = time.monotonic()
            proxy.stall()
            wait_until(lambda: not io.consuming.is_set(), 30, "the heartbeats to notice")
            noticed = time.monotonic() - stalled
            proxy.resume()
        finally:
            go.set()
        wait_until(lambda: set(seen) >= set(ids), 60, "every message handled")
        assert io.recoveries >= 1 and io.fatal is None
    # Two heartbeats of silence, checked every half heartbeat: 2 to 2.5 s (pika's own checker
    # alone took 6 to 12 s at heartbeat=1); the rest is slack for a loaded machine.
    assert noticed < 5.5, f"a stalled link was noticed after {noticed:.1f} s"
    assert broker.count(queue) == 0


def test_a_declaring_consumer_declares_its_deleted_queue_again(
    amqp_url: str, broker: BrokerAdmin, own_queues: list[str]
) -> None:
    """``declare=True``: after the broker's basic.cancel the consumer declares the queue again
    itself (durable, with its arguments) and consumes what arrives next."""
    queue = unique("c-redeclare")
    own_queues.append(queue)
    seen: list[str] = []
    consumer = Consumer(
        amqp_url,
        queue,
        prefetch=10,
        redelivery=QUICK,
        declare=True,
        queue_arguments={"x-max-priority": 3},
    )
    io = consumer._core.io
    assert isinstance(io, ConsumerIO)
    try:
        with running(consumer, lambda d: seen.append(d.message_id or "")):
            wait_until(io.consuming.is_set, 30, "the first subscription")
            fill(amqp_url, queue, ["a0", "a1"])
            wait_until(lambda: len(seen) == 2, 30, "the first messages handled")
            generation = io.generation
            broker.channel.queue_delete(queue)
            wait_until(
                lambda: io.consuming.is_set() and io.generation > generation, 60, "resubscribed"
            )
            # Declared again with the same arguments: a declare with others would fail (406)
            broker.channel.queue_declare(
                queue, passive=False, durable=True, arguments={"x-max-priority": 3}
            )
            fill(amqp_url, queue, ["b0", "b1"])
            wait_until(lambda: len(seen) == 4, 30, "the messages sent after the redeclare")
        assert seen == ["a0", "a1", "b0", "b1"]
        assert io.fatal is None
    finally:
        delete_queues(amqp_url, [queue])


@pytest.mark.slow
@pytest.mark.faults
def test_broker_killed_and_restarted_under_a_running_consumer(
    disposable_broker: DisposableBroker,
) -> None:
    """The node dies (kill -9) mid-run and comes back: the consumer reconnects under its
    policy, subscribes again and handles every persistent message of the durable queue."""
    node = disposable_broker
    admin = BrokerAdmin(node.url)
    queue = admin.queue(unique("c-nodekill"))
    ids = [f"m{i:04d}" for i in range(2000)]
    fill(node.url, queue, ids)  # persistent (the library's default), confirmed
    go = threading.Event()
    seen: list[str] = []

    def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id or "")
        if len(seen) == 500:
            assert go.wait(120)  # paused while the node dies and comes back

    # Retries at most 1 s apart, so the test does not wait out a long backoff once the node is
    # back (the default policy's delays grow to 15 s)
    patient = RetryPolicy(max_attempts=None, initial_delay=0.2, max_delay=1.0, deadline=120)
    consumer = Consumer(node.url, queue, prefetch=100, redelivery=QUICK, connect_policy=patient)
    io = consumer._core.io
    assert isinstance(io, ConsumerIO)
    try:
        with running(consumer, handler):
            try:
                wait_until(lambda: len(seen) >= 500, 60, "500 messages handled")
                node.kill()
                wait_until(lambda: not io.consuming.is_set(), 30, "the loss noticed")
                node.start()
            finally:
                go.set()
            wait_until(lambda: set(seen) >= set(ids), 120, "every message handled")
            assert io.recoveries >= 1 and io.fatal is None
        admin = BrokerAdmin(node.url)  # the first one died with the node
        assert admin.count(queue) == 0
    finally:
        admin.close()
        delete_queues(node.url, [queue, *side_queues(queue, QUICK)])
