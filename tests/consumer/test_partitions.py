"""Partitions over several consumers (issue 46, docs/consumer.md "Partitions"), real broker.

Members here are several ``Consumer(partitions=N)`` objects in one process: each is a member of
its own (its own connections), as a process would be. Killed processes are
tests/consumer/test_partitions_chain.py's; the cluster is tests/cluster's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pika
import pytest

from harness.fixtures import ProxyFactory
from harness.node import DisposableBroker
from reliable_amqp import (
    AsyncConsumer,
    ConfigurationError,
    Consumer,
    Delivery,
    Publisher,
    RetryPolicy,
)
from reliable_amqp._consume import _group as group_module
from reliable_amqp._consume._group import PartitionGroup
from reliable_amqp._consume._group_view import GroupView
from reliable_amqp._consume._lifecycle import product_of
from reliable_amqp._core.errors import PreconditionFailed
from reliable_amqp._core.partitions import (
    config_queue,
    lock_queue,
    member_queue,
    partition_queues,
)
from reliable_amqp._core.refusals import QueueNotFound
from support.broker import unique
from support.consumer import delete_queues, running, side_queues, wait_until

pytestmark = pytest.mark.broker

RETRY = RetryPolicy(max_attempts=4, initial_delay=0.1, max_delay=0.3, jitter=0.0)
N = 8


def _group(consumer: Consumer | AsyncConsumer) -> PartitionGroup:
    io = consumer._core.io
    assert isinstance(io, PartitionGroup)
    return io


def _consumer_counts(url: str, name: str) -> list[int]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        return [
            channel.queue_declare(q, passive=True).method.consumer_count
            for q in partition_queues(name, N)
        ]
    finally:
        connection.close()


def _one_consumer_each(url: str, name: str) -> None:
    """Wait until the broker counts one consumer on every partition (subscriptions just made
    may still be on their way); never more than one."""
    seen: list[list[int]] = []

    def one_each() -> bool:
        counts = _consumer_counts(url, name)
        seen.append(counts)
        assert max(counts) <= 1, f"a partition with two consumers: {counts}"
        return counts == [1] * N

    wait_until(one_each, 30, "one consumer on every partition")


@pytest.fixture
def name(amqp_url: str) -> Iterator[str]:
    group = unique("c-part")
    yield group
    # (the group's slots and locks are exclusive queues: gone with their connections)
    queues = [*partition_queues(group, N), config_queue(group)]
    side = [s for q in partition_queues(group, N) for s in side_queues(q, RETRY)[1:]]
    # a consumer with the default policy declares its delay queues too (at start: before it
    # finds the partition queues missing), and one with half the partitions
    for count in (N, N // 2):
        side += Consumer(amqp_url, group, partitions=count).own_queues
    delete_queues(amqp_url, [*queues, *side, f"{group}.dead"])
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        connection.channel().exchange_delete(group)
    finally:
        connection.close()


def _member(url: str, name: str, **kwargs: object) -> Consumer:
    return Consumer(
        url,
        name,
        partitions=N,
        declare=True,
        key="routing_key",
        redelivery=RETRY,
        prefetch=20,
        stop_timeout=10,
        **kwargs,  # type: ignore[arg-type]
    )


class Effects:
    """What the handlers did, by key, from every member (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, list[int]] = defaultdict(list)
        self.partitions: dict[str, set[str]] = defaultdict(set)
        self.count = 0

    def handler(self, delay: float = 0.0) -> object:
        def handle(delivery: Delivery) -> None:
            if delay:
                time.sleep(delay)
            with self.lock:
                self.by_key[delivery.routing_key].append(int(delivery.body))
                self.partitions[delivery.routing_key].add(delivery.queue)
                self.count += 1

        return handle


def _publish(url: str, name: str, keys: int, per_key: int, start: int = 0) -> None:
    with Publisher(url) as publisher:
        for seq in range(start, start + per_key):
            for k in range(keys):
                publisher.publish(name, f"key-{k}", str(seq).encode())
        assert publisher.flush(60) == 0


def test_bad_partitions_are_refused_before_anything_connects(amqp_url: str) -> None:
    for bad in (0, True, "8", 2.0, 5000):
        with pytest.raises(ConfigurationError, match="partitions must be an integer"):
            Consumer(amqp_url, "orders", partitions=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="too long"):
        Consumer(amqp_url, "x" * 195, partitions=2)


def test_missing_partition_queues_end_run_naming_declare(amqp_url: str, name: str) -> None:
    consumer = Consumer(amqp_url, name, partitions=N)
    started = time.monotonic()
    with pytest.raises(QueueNotFound, match="declare=True"):
        consumer.run(lambda d: None)
    assert time.monotonic() - started < 30


def test_a_partition_queue_declared_otherwise_is_refused_loudly(amqp_url: str, name: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:  # partition 3 exists as a quorum queue; the consumer asks for classic ones
        connection.channel().queue_declare(
            partition_queues(name, N)[3], durable=True, arguments={"x-queue-type": "quorum"}
        )
    finally:
        connection.close()
    consumer = _member(amqp_url, name)
    with pytest.raises(PreconditionFailed, match=partition_queues(name, N)[3]):  # 406
        consumer.run(lambda d: None)


def test_one_member_takes_every_partition_and_keeps_key_order(
    amqp_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    effects = Effects()
    consumer = _member(amqp_url, name)
    with running(consumer, effects.handler()):  # type: ignore[arg-type]
        wait_until(lambda: len(_group(consumer).held) == N, 30, "all partitions held")
        _publish(amqp_url, name, keys=50, per_key=10)
        wait_until(lambda: effects.count >= 500, 60, "500 handled")
    assert effects.count == 500
    for key, seqs in effects.by_key.items():
        assert seqs == list(range(10)), key
        assert len(effects.partitions[key]) == 1  # a key always lands in one partition
    used = set().union(*effects.partitions.values())
    assert len(used) >= N - 2  # 50 keys spread over the partitions (a hash: most, not all)
    # nothing warns about a broker's hand-over any more (LavinMQ's is handled: below)
    assert not [r for r in caplog.records if "single-active-consumer" in r.getMessage()]


def test_members_share_evenly_and_a_rebalance_neither_loses_nor_reorders(
    amqp_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    effects = Effects()
    first = _member(amqp_url, name)
    second = _member(amqp_url, name)
    third = _member(amqp_url, name)
    with running(first, effects.handler(0.002)):  # type: ignore[arg-type]
        wait_until(lambda: len(_group(first).held) == N, 30, "the first member holding all")
        sender = threading.Thread(target=_publish, args=(amqp_url, name, 40, 30))
        sender.start()  # 1,200 messages while the group grows: partitions move mid-flow
        with running(second, effects.handler(0.002)):  # type: ignore[arg-type]
            wait_until(
                lambda: sorted([len(_group(first).held), len(_group(second).held)]) == [4, 4],
                30,
                "4 and 4",
            )
            _one_consumer_each(amqp_url, name)
            with running(third, effects.handler(0.002)):  # type: ignore[arg-type]
                groups = [_group(c) for c in (first, second, third)]
                wait_until(
                    lambda: sorted(len(g.held) for g in groups) == [2, 3, 3],
                    30,
                    "3, 3 and 2",
                )
                held = [p for g in groups for p in g.held]
                assert sorted(held) == list(range(N))  # each partition held once
                # health() tells an operator which partitions each member holds
                healths = [c.health() for c in (first, second, third)]
                assert sorted(p for h in healths for p in h.partitions or ()) == list(range(N))
                assert all(h.healthy for h in healths)
                _one_consumer_each(amqp_url, name)
                sender.join(60)
                wait_until(lambda: effects.count >= 1200, 60, "1,200 handled")
            # the third left (gracefully): its partitions are taken again
            wait_until(
                lambda: sorted([len(_group(first).held), len(_group(second).held)]) == [4, 4],
                30,
                "4 and 4 again",
            )
            _publish(amqp_url, name, keys=40, per_key=5, start=30)
            wait_until(lambda: effects.count >= 1400, 60, "1,400 handled")
    assert effects.count == 1400  # exactly once: a partition given up finished its work
    for key, seqs in effects.by_key.items():
        assert seqs == list(range(35)), f"{key}: {seqs}"
    # the group's probes (another member's slot or lock: 405) leave the user's log clean
    # (pika's records on the group's thread are the library's: reliable_amqp._logs)
    noise = [r.getMessage() for r in caplog.records if r.name.startswith("pika")]
    assert not [m for m in noise if "Channel.Close" in m], noise[:3]


def test_retries_come_back_to_their_own_partition_in_key_order(amqp_url: str, name: str) -> None:
    effects = Effects()
    failed: set[str] = set()
    lock = threading.Lock()
    record = effects.handler()

    def handler(delivery: Delivery) -> None:
        with lock:
            first = delivery.body.endswith(b"3") and delivery.message_id not in failed
            if first:
                failed.add(delivery.message_id or "")
        if first:
            raise RuntimeError("the first attempt of every 3rd, 13th, 23rd... fails")
        record(delivery)  # type: ignore[operator]

    consumer = _member(amqp_url, name)
    with running(consumer, handler):
        wait_until(lambda: len(_group(consumer).held) == N, 30, "all partitions held")
        _publish(amqp_url, name, keys=20, per_key=30)
        wait_until(lambda: effects.count >= 600, 60, "600 handled")
    assert consumer.stats.retried == 20 * 3
    for key, seqs in effects.by_key.items():
        assert seqs == list(range(30)), key
        assert len(effects.partitions[key]) == 1


def test_a_broker_without_the_hash_exchange_ends_run_with_the_command(
    disposable_broker: DisposableBroker,
) -> None:
    """The broker answers as one without the plugin does (503 unknown exchange type): the
    type is unregistered on the node for the test (the plugin's module stays loaded)."""
    erl = disposable_broker.erl
    erl('rabbit_registry:unregister(exchange, <<"x-consistent-hash">>).')
    try:
        consumer = Consumer(
            disposable_broker.url, unique("c-part-noplugin"), partitions=2, declare=True
        )
        started = time.monotonic()
        with pytest.raises(ConfigurationError) as caught:
            consumer.run(lambda d: None)
        assert time.monotonic() - started < 30
        text = str(caught.value)
        assert "rabbitmq-plugins enable rabbitmq_consistent_hash_exchange" in text
        assert "503 COMMAND_INVALID" in text
    finally:
        erl(
            'rabbit_registry:register(exchange, <<"x-consistent-hash">>, '
            "rabbit_exchange_type_consistent_hash).",
        )


def test_a_slot_or_lock_granted_to_two_connections_ends_with_one(
    amqp_url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """LavinMQ 2.9.1 grants a new exclusive queue to every connection whose declaration meets
    another's (docs/brokers.md, "Partitioned consumers"): two members then held one slot (the
    group counted too few members and never settled) or one lock. Two views on one connection
    are granted the same exclusive queue on any broker: each must find the other's hold and
    one of them give the queue up."""
    caplog.set_level(logging.INFO, logger="reliable_amqp")
    params = pika.URLParameters(amqp_url)
    first = GroupView(params, name, N, None)
    second = GroupView(params, name, N, None)
    second.close()
    second.connection = first.connection  # (as LavinMQ's second connection: granted too)
    second._channel = first.connection.channel()
    try:
        first.take_slot()
        second.take_slot()  # slot 0 is granted, held twice: given up, slot 1 taken
        assert (first.slot, second.slot) == (0, 1)
        first.wait(10)  # ends early: the broker deleted slot 0 under the first
        assert first.lost == [member_queue(name, 0)]
        assert first.regain() == []
        assert (first.slot, second.slot) == (0, 1)  # the first took its slot back

        assert first.lock(3)
        assert not second.lock(3)
        first.wait(10)
        assert first.lost == [lock_queue(name, 3)]
        assert first.regain() == [3]  # the group locks it again (or gives the partition up)
        assert first.lock(3)
        assert not first.lost
        held = first.connection.channel().queue_declare(lock_queue(name, 3), passive=True)
        assert held.method.consumer_count == 1
    finally:
        first.close()
    shared = [r.levelname for r in caplog.records if "to another connection" in r.getMessage()]
    assert shared == ["WARNING", "INFO"]  # said each time, loudly the first time


def test_a_partition_consumed_without_its_lock_waits_for_that_consumer_on_lavinmq(
    amqp_url: str, name: str
) -> None:
    """LavinMQ hands a single-active-consumer queue to a consumer already waiting before it
    requeues what the closed one held (docs/brokers.md): there a member takes no partition that
    still has a consumer without a lock (a member cut off, its partition connection not yet
    dropped by the broker) until that consumer is gone. RabbitMQ keeps that hand-over's order:
    a member takes the partition at once (the other consumer stays the active one meanwhile)."""
    first = _member(amqp_url, name)  # declares the group, then leaves it
    with running(first, lambda d: None):
        wait_until(lambda: len(_group(first).held) == N, 30, "all partitions held")
    lavinmq = product_of(_group(first).server_properties).startswith("LavinMQ")
    stray = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        stray.channel().basic_consume(partition_queues(name, N)[3], lambda *a: None)
        member = _member(amqp_url, name)
        with running(member, lambda d: None):
            group = _group(member)
            if not lavinmq:
                wait_until(lambda: len(group.held) == N, 30, "all partitions held")
                return
            wait_until(lambda: len(group.held) == N - 1, 30, "all partitions but one held")
            time.sleep(3)  # three rounds: partition 3 is left alone
            assert 3 not in group.held
            stray.close()
            wait_until(lambda: len(group.held) == N, 30, "partition 3 taken once free")
    finally:
        if stray.is_open:
            stray.close()


def test_a_partition_whose_connection_is_lost_waits_for_its_old_consumer_on_lavinmq(
    amqp_url: str,
    name: str,
    make_proxy: ProxyFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The rest of LavinMQ's out-of-order hand-over (docs/brokers.md): a member's own partition
    connection lost while the broker still holds its consumer. On LavinMQ the member does not
    subscribe again behind that consumer (the messages it held would come after later ones);
    the partition ends, and the group takes it again once the broker has no consumer on it.

    The consumer the broker still holds is played by a stray one waiting on partition 3: when
    the member's connections are cut, the broker makes it the active consumer, as it would the
    old one. On a broker other than LavinMQ the member is told it is on LavinMQ (its product
    string), so the path LavinMQ takes runs against this broker."""
    caplog.set_level(logging.INFO, logger="reliable_amqp")
    first = _member(amqp_url, name)  # declares the group, then leaves it
    with running(first, lambda d: None):
        wait_until(lambda: len(_group(first).held) == N, 30, "all partitions held")
    if not product_of(_group(first).server_properties).startswith("LavinMQ"):
        monkeypatch.setattr(group_module, "product_of", lambda _props: "LavinMQ (as if)")
    proxy = make_proxy()
    effects = Effects()
    member = _member(proxy.url(), name)
    stray = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        with running(member, effects.handler()):  # type: ignore[arg-type]
            group = _group(member)
            wait_until(lambda: len(group.held) == N, 30, "all partitions held")
            _one_consumer_each(amqp_url, name)
            _publish(amqp_url, name, keys=40, per_key=5)
            wait_until(lambda: effects.count >= 200, 60, "200 handled")
            stray.channel().basic_consume(partition_queues(name, N)[3], lambda *a: None)
            proxy.cut()  # every connection of the member: the stray becomes partition 3's
            # The member takes the other seven again and leaves partition 3 to the stray:
            # never a second consumer on a partition (one subscribing behind the stray).
            others = [p for p in range(N) if p != 3]
            wait_until(lambda: set(others) <= set(group.held), 30, "the other seven held")
            wait_until(
                lambda: min(_consumer_counts(amqp_url, name)[p] for p in others) == 1,
                30,
                "the other seven subscribed",
            )
            for _ in range(3):  # about three rounds of the group
                counts = _consumer_counts(amqp_url, name)
                assert counts[3] == 1 and max(counts) == 1, counts
                assert 3 not in group.held
                time.sleep(1)
            stray.close()
            wait_until(lambda: len(group.held) == N, 30, "partition 3 taken once free")
            _one_consumer_each(amqp_url, name)
            _publish(amqp_url, name, keys=40, per_key=5, start=5)
            wait_until(
                lambda: (
                    all(seqs[-1:] == [9] for seqs in effects.by_key.values())
                    and len(effects.by_key) == 40
                ),
                60,
                "every key's last event handled",
            )
    finally:
        if stray.is_open:
            stray.close()
    for key, seqs in effects.by_key.items():
        firsts = list(dict.fromkeys(seqs))  # (a delivery cut mid-way may run again)
        assert firsts == list(range(10)), key
    lost = [r for r in caplog.records if "lost partition" in r.getMessage()]
    assert lost and all(r.levelname == "INFO" for r in lost)
    assert any(partition_queues(name, N)[3] in r.getMessage() for r in lost)


def test_a_member_counting_other_partitions_is_refused(amqp_url: str, name: str) -> None:
    effects = Effects()
    consumer = _member(amqp_url, name)
    with running(consumer, effects.handler()):  # type: ignore[arg-type]
        wait_until(lambda: len(_group(consumer).held) == N, 30, "all partitions held")
        other = Consumer(amqp_url, name, partitions=N // 2, declare=True)
        with pytest.raises(ConfigurationError, match=f"partitions={N // 2}.*same number"):
            other.run(lambda d: None)
        assert len(_group(consumer).held) == N


def test_members_started_at_once_on_quorum_partitions_never_share_one(
    amqp_url: str, name: str
) -> None:
    """Quorum queues ignore an exclusive basic.consume (a second one is accepted): ownership
    is the lock queue's (classic), and single active consumer guards the partition itself."""
    effects = Effects()
    quorum = {"x-queue-type": "quorum"}
    members = [_member(amqp_url, name, queue_arguments=quorum) for _ in range(3)]
    groups = [_group(c) for c in members]
    with contextlib.ExitStack() as stack:
        for member in members:  # all three race for the same free partitions
            stack.enter_context(running(member, effects.handler()))  # type: ignore[arg-type]
        wait_until(lambda: sorted(len(g.held) for g in groups) == [2, 3, 3], 30, "3, 3, 2")
        held = [p for g in groups for p in g.held]
        assert sorted(held) == list(range(N))
        # a slot each (LavinMQ had granted one slot to two members declaring it at once; which
        # slots they end in depends on who gave up which)
        slots = {g._view.slot for g in groups if g._view is not None}
        assert len(slots) == 3 and None not in slots, slots
        _publish(amqp_url, name, keys=40, per_key=15)
        wait_until(lambda: effects.count >= 600, 60, "600 handled")
    assert effects.count == 600
    for key, seqs in effects.by_key.items():
        assert seqs == list(range(15)), key


def test_async_members_with_concurrency_keep_every_keys_order(amqp_url: str, name: str) -> None:
    """AsyncConsumer(partitions=N, concurrency=16): the partitions' threads feed the loop."""
    effects = Effects()
    record = effects.handler()

    async def handler(delivery: Delivery) -> None:
        await asyncio.sleep(0.001)
        record(delivery)  # type: ignore[operator]

    async def main() -> None:
        members = [
            AsyncConsumer(
                amqp_url,
                name,
                partitions=N,
                declare=True,
                key="routing_key",
                concurrency=16,
                prefetch=50,
                redelivery=RETRY,
            )
            for _ in range(2)
        ]
        groups = [_group(m) for m in members]
        runs = [asyncio.create_task(m.run(handler)) for m in members]
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None, wait_until, lambda: sorted(len(g.held) for g in groups) == [4, 4], 30, "4, 4"
        )
        await loop.run_in_executor(None, _publish, amqp_url, name, 100, 10)
        await loop.run_in_executor(
            None, wait_until, lambda: effects.count >= 1000, 60, "1,000 handled"
        )
        for member in members:
            member.stop()
        await asyncio.gather(*runs)

    asyncio.run(main())
    assert effects.count == 1000
    for key, seqs in effects.by_key.items():
        assert seqs == list(range(10)), key
