"""Per-key order in one consumer (issue 46, docs/consumer.md "Order"), against the real broker.

A key's messages are handled one at a time in the order the queue delivered them, also while
one of them is retried after a delay: the key's later messages wait (parked in the broker,
behind it) while every other key flows. Effects are recorded per key and compared with the
publish order.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import defaultdict
from collections.abc import Iterator

import pika
import pytest

from reliable_amqp import (
    AsyncConsumer,
    ConfigurationError,
    Consumer,
    Delivery,
    Publisher,
    RetryPolicy,
)
from support.broker import BrokerAdmin, unique
from support.consumer import delete_queues, running, side_queues, wait_until

pytestmark = pytest.mark.broker

RETRY = RetryPolicy(max_attempts=4, initial_delay=0.1, max_delay=0.3, jitter=0.0)


@pytest.fixture
def queue(amqp_url: str, broker: BrokerAdmin) -> Iterator[str]:
    name = broker.queue(unique("c-order"))
    yield name
    delete_queues(amqp_url, [name, *side_queues(name, RETRY)])


def publish_events(url: str, queue: str, keys: int, per_key: int) -> list[tuple[str, int]]:
    """``keys`` x ``per_key`` events, interleaved across keys; routing key = the key (the
    default exchange routes by queue name, so the key travels in a header and in the id)."""
    events = [(f"k{k:03d}", n) for n in range(per_key) for k in range(keys)]
    with Publisher(url, max_in_flight=2000) as publisher:
        for key, n in events:
            publisher.publish(
                "", queue, b"", message_id=f"{key}/{n}", headers={"entity": key, "n": n}
            )
        assert publisher.flush(120) == 0
    return events


def check_order(effects: dict[str, list[int]], keys: int, per_key: int) -> None:
    out_of_order = [k for k, seq in effects.items() if seq != sorted(seq)]
    assert not out_of_order, (
        f"{len(out_of_order)} keys out of order, e.g. {effects[out_of_order[0]]}"
    )
    assert len(effects) == keys
    for key, seq in effects.items():
        assert seq == list(range(per_key)), (key, seq)  # each event once, in order


def test_async_concurrency_16_with_retries_keeps_every_keys_order(
    amqp_url: str, queue: str, broker: BrokerAdmin
) -> None:
    """200 keys x 50 events, 5% of first attempts failing (retried after a delay): every
    key's effects in publish order, every event exactly once."""
    keys, per_key = 200, 50
    publish_events(amqp_url, queue, keys, per_key)
    rng = random.Random(46)
    failing = {f"k{k:03d}/{n}" for k in range(keys) for n in range(per_key) if rng.random() < 0.05}
    effects: dict[str, list[int]] = defaultdict(list)
    running_keys: set[str] = set()
    overlaps: list[str] = []
    total = keys * per_key
    consumer = AsyncConsumer(
        amqp_url,
        queue,
        prefetch=200,
        concurrency=16,
        key="header:entity",
        redelivery=RETRY,
    )
    done = 0

    async def handler(delivery: Delivery) -> None:
        nonlocal done
        key = str(delivery.headers["entity"])
        if key in running_keys:
            overlaps.append(key)
        running_keys.add(key)
        try:
            await asyncio.sleep(0)  # let other workers run meanwhile
            if delivery.attempt == 1 and delivery.message_id in failing:
                raise RuntimeError("a transient failure")
            effects[key].append(int(delivery.headers["n"]))
            done += 1
            if done == total:
                consumer.stop()
        finally:
            running_keys.discard(key)

    asyncio.run(asyncio.wait_for(consumer.run(handler), 240))
    assert not overlaps, f"a key ran twice at once: {overlaps[:5]}"
    check_order(effects, keys, per_key)
    assert consumer.stats.retried == len(failing) and consumer.stats.parked > 0
    assert broker.count(queue) == 0


def test_sync_consumer_keeps_a_keys_order_through_retries(
    amqp_url: str, queue: str, broker: BrokerAdmin
) -> None:
    keys, per_key = 20, 30
    publish_events(amqp_url, queue, keys, per_key)
    effects: dict[str, list[int]] = defaultdict(list)
    fails = {"k003/0", "k003/1", "k007/10", "k011/29"}
    consumer = Consumer(amqp_url, queue, prefetch=50, key="header:entity", redelivery=RETRY)

    def handler(delivery: Delivery) -> None:
        if delivery.attempt <= 2 and delivery.message_id in fails:
            raise RuntimeError("fails twice")
        effects[str(delivery.headers["entity"])].append(int(delivery.headers["n"]))

    with running(consumer, handler):
        wait_until(lambda: sum(map(len, effects.values())) == keys * per_key, 120, "all events")
    check_order(effects, keys, per_key)
    assert broker.count(queue) == 0


def test_a_dead_lettered_message_lets_its_key_go_on_by_default(
    amqp_url: str, queue: str, broker: BrokerAdmin
) -> None:
    publish_events(amqp_url, queue, 3, 5)
    effects: dict[str, list[int]] = defaultdict(list)
    consumer = Consumer(amqp_url, queue, key="header:entity", redelivery=RETRY)

    def handler(delivery: Delivery) -> None:
        if delivery.message_id == "k001/1":
            raise RuntimeError("always fails")
        effects[str(delivery.headers["entity"])].append(int(delivery.headers["n"]))

    with running(consumer, handler):
        wait_until(lambda: sum(map(len, effects.values())) == 14, 60, "the other 14 events")
        wait_until(lambda: consumer.stats.dead_lettered == 1, 60, "the dead letter")
    assert effects["k001"] == [0, 2, 3, 4] and effects["k000"] == effects["k002"] == list(range(5))
    assert broker.count(f"{queue}.dead") == 1


def test_hold_keeps_the_key_waiting_until_its_dead_letter_comes_back(
    amqp_url: str, queue: str, broker: BrokerAdmin
) -> None:
    """after_dead_letter="hold": the key's later messages wait (parked) until the dead
    message is put back in the queue (as `dead-letters --requeue` does) and succeeds."""
    publish_events(amqp_url, queue, 2, 4)
    effects: dict[str, list[int]] = defaultdict(list)
    healed = threading.Event()
    consumer = Consumer(
        amqp_url, queue, key="header:entity", redelivery=RETRY, after_dead_letter="hold"
    )

    def handler(delivery: Delivery) -> None:
        if delivery.message_id == "k001/1" and not healed.is_set():
            raise RuntimeError("fails until healed")
        effects[str(delivery.headers["entity"])].append(int(delivery.headers["n"]))

    with running(consumer, handler):
        wait_until(lambda: consumer.stats.dead_lettered == 1, 60, "the dead letter")
        wait_until(lambda: len(effects["k000"]) == 4, 60, "the other key's events")
        assert effects["k001"] == [0]  # 2 and 3 wait behind the dead 1
        wait_until(lambda: consumer.stats.parked >= 2, 60, "the key's later events parked")
        healed.set()
        # put the dead letter back, as the CLI's --requeue does: same message_id
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        channel = connection.channel()
        method, props, body = channel.basic_get(f"{queue}.dead", auto_ack=False)
        assert method is not None
        channel.basic_publish("", queue, body, props)
        channel.basic_ack(method.delivery_tag)
        connection.close()
        wait_until(lambda: len(effects["k001"]) == 4, 60, "the held key's events")
    assert effects["k001"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("routing-key", "key must be"),
        ("header:", "key must be"),
        (42, "key must be"),
    ],
)
def test_a_bad_key_option_is_refused(key: object, words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        Consumer("amqp://127.0.0.1", "q", key=key)  # type: ignore[arg-type]


def test_an_async_key_callable_is_refused() -> None:
    async def key(delivery: Delivery) -> str:
        return "k"

    with pytest.raises(ConfigurationError, match="plain callable"):
        AsyncConsumer("amqp://127.0.0.1", "q", key=key)  # type: ignore[arg-type]
