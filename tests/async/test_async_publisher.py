"""AsyncPublisher against the real local broker: the sync suite's cases, for asyncio.

Each test mirrors the test of the same name in tests/test_publisher.py, so the two suites can be
folded into one parametrized suite (see docs/async.md, "Testing").
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

import pika
import pytest

from harness.fixtures import ProxyFactory
from reliable_amqp import (
    AuthenticationFailed,
    ConfigurationError,
    Confirmation,
    DeliveryTimeout,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    PreconditionFailed,
    PublisherClosed,
    PublishTimeout,
    RetryPolicy,
    State,
)
from reliable_amqp._async import AsyncPublisher
from support.aio import aio, outcomes
from support.broker import AMQP_DEFAULT_PORT, BrokerAdmin, unique

pytestmark = pytest.mark.broker

FAST_NACKS = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.05, jitter=0.0)


@aio
async def test_every_message_confirmed_and_in_the_queue(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    n = 3000
    async with AsyncPublisher(amqp_url) as publisher:
        assert publisher.state is State.OPEN
        futures = [await publisher.publish("", queue, b"m%05d" % i) for i in range(n)]
        assert await publisher.flush(timeout=30) == 0
    # cast: mypy keeps publisher.state narrowed to OPEN from inside the block
    assert cast(State, publisher.state) is State.CLOSED
    results = [f.result() for f in futures]
    assert all(r.attempts == 1 for r in results)
    assert len({r.message_id for r in results}) == n
    assert broker.count(queue) == n
    received = broker.drain(queue)
    assert [body for _, body in received] == [b"m%05d" % i for i in range(n)]
    assert [p.message_id for p, _ in received] == [r.message_id for r in results]
    assert {p.delivery_mode for p, _ in received} == {2}  # persistent by default


@aio
async def test_properties_and_headers_arrive_intact(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue(x_max_priority=5)
    async with AsyncPublisher(amqp_url) as publisher:
        confirmation = await publisher.publish_and_wait(
            "",
            queue,
            b"{}",
            headers={"tenant": "acme", "n": 7, "nested": {"ok": True}, "tags": ["a", "b"]},
            message_id="order-42",
            content_type="application/json",
            correlation_id="corr-1",
            expiration=60000,
            priority=3,
            app_id="tests",
        )
    assert confirmation == Confirmation("order-42", 1)
    [(props, body)] = broker.drain(queue)
    assert body == b"{}"
    assert props.message_id == "order-42"
    assert props.content_type == "application/json"
    assert props.correlation_id == "corr-1"
    assert props.expiration == "60000"
    assert props.priority == 3
    assert props.app_id == "tests"
    assert props.headers["tenant"] in (b"acme", "acme")
    assert props.headers["n"] == 7
    assert props.headers["nested"] == {"ok": True}


@aio
async def test_nacks_are_retried_then_fail(amqp_url: str, broker: BrokerAdmin) -> None:
    # A full queue with reject-publish makes RabbitMQ nack for real.
    queue = broker.queue(x_max_length=5, x_overflow="reject-publish")
    async with AsyncPublisher(amqp_url, nack_policy=FAST_NACKS) as publisher:
        futures = [await publisher.publish("", queue, b"%d" % i) for i in range(20)]
        assert await publisher.flush(timeout=30) == 0
    assert await outcomes(futures) == {"Confirmation": 5, "MessageNacked": 15}
    nacked = [f.exception() for f in futures if f.exception() is not None]
    assert all(isinstance(e, MessageNacked) and e.attempts == 3 for e in nacked)
    bodies = {body for _, body in broker.drain(queue)}
    assert {e.message.body for e in nacked if isinstance(e, MessageNacked)}.isdisjoint(bodies)


@aio
async def test_nacked_messages_succeed_once_the_queue_has_room(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue(x_max_length=5, x_overflow="reject-publish")
    patient = RetryPolicy(max_attempts=50, initial_delay=0.02, max_delay=0.2, jitter=0.01)
    received: list[bytes] = []
    start, stop = threading.Event(), threading.Event()

    def consume() -> None:
        start.wait()
        # A push consumer: with basic.get polling, RabbitMQ 3.10 was seen to confirm messages
        # to a reject-publish queue and then drop them (the sync suite shows it too).
        connection = pika.BlockingConnection(pika.URLParameters(broker.url))
        channel = connection.channel()
        channel.basic_consume(queue, lambda _ch, _m, _p, body: received.append(body), True)
        try:
            while not stop.is_set():
                connection.process_data_events(0.05)
        finally:
            connection.close()

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        async with AsyncPublisher(amqp_url, nack_policy=patient) as publisher:
            futures = [await publisher.publish("", queue, b"%03d" % i) for i in range(60)]
            await asyncio.sleep(0.1)  # the queue is full and nacks are under way
            start.set()
            assert await publisher.flush(timeout=60) == 0
    finally:
        start.set()
        await asyncio.sleep(0.2)
        stop.set()
        consumer.join()
    received.extend(body for _, body in broker.drain(queue))
    assert await outcomes(futures) == {"Confirmation": 60}
    assert max(f.result().attempts for f in futures) > 1  # some really were nacked first
    assert sorted(received) == [b"%03d" % i for i in range(60)]


@aio
async def test_unroutable_mandatory_messages_are_returned(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    exchange = broker.exchange()
    queue = broker.queue()
    broker.bind(queue, exchange, "routed")
    async with AsyncPublisher(amqp_url) as publisher:
        # The same message_id on both: returns are matched per attempt, not by the user's id.
        routed = [
            await publisher.publish(exchange, "routed", b"r", mandatory=True, message_id="same")
            for _ in range(10)
        ]
        lost = [
            await publisher.publish(exchange, "nowhere", b"l", mandatory=True, message_id="same")
            for _ in range(10)
        ]
        unchecked = await publisher.publish(exchange, "nowhere", b"u", mandatory=False)  # acked
        default = await publisher.publish(exchange, "nowhere", b"d")  # mandatory by default
        await publisher.flush(timeout=30)
    assert await outcomes([default]) == {"MessageReturned": 1}
    assert await outcomes(routed) == {"Confirmation": 10}
    assert await outcomes(lost) == {"MessageReturned": 10}
    error = lost[0].exception()
    assert isinstance(error, MessageReturned)
    assert error.reply_code == 312 and "NO_ROUTE" in error.reply_text
    assert error.message.routing_key == "nowhere"
    assert unchecked.result().attempts == 1
    assert broker.count(queue) == 10


@aio
async def test_missing_exchange_fails_only_that_message(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    missing = unique("no-such-exchange")
    async with AsyncPublisher(amqp_url) as publisher:
        before = [await publisher.publish("", queue, b"b%03d" % i) for i in range(200)]
        bad = await publisher.publish(missing, "rk", b"nowhere")
        after = [await publisher.publish("", queue, b"a%03d" % i) for i in range(200)]
        await publisher.flush(timeout=30)
        later = await publisher.publish_and_wait("", queue, b"later")  # still usable
    error = bad.exception()
    assert isinstance(error, MessageRejected)
    assert error.reply_code == 404 and missing in error.reply_text
    assert error.message.exchange == missing
    assert await outcomes(before + after) == {"Confirmation": 400}
    assert later.attempts == 1
    # At least once: what the broker had queued but not confirmed when the channel closed was
    # republished; a duplicate carries its original's message_id.
    received = broker.drain(queue)
    expected = {b"b%03d" % i for i in range(200)} | {b"a%03d" % i for i in range(200)}
    assert {body for _, body in received} == expected | {b"later"}
    by_body: dict[bytes, set[str]] = {}
    for props, body in received:
        by_body.setdefault(body, set()).add(props.message_id)
    assert all(len(ids) == 1 for ids in by_body.values())
    ids = {f.result().message_id for f in before + after}
    assert {props.message_id for props, body in received if body != b"later"} == ids


@pytest.mark.slow
@aio
async def test_oversize_body_is_rejected_and_others_go_on(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    huge = b"\0" * (128 * 1024 * 1024 + 1)  # RabbitMQ's default max_message_size + 1
    async with AsyncPublisher(amqp_url) as publisher:
        small = [await publisher.publish("", queue, b"s%d" % i) for i in range(50)]
        big = await publisher.publish("", queue, huge)
        more = [await publisher.publish("", queue, b"t%d" % i) for i in range(50)]
        await publisher.flush(timeout=60)
        assert (await publisher.publish_and_wait("", queue, b"after")).attempts == 1
    error = big.exception()
    assert isinstance(error, MessageRejected)
    assert error.reply_code == 406 and "size" in error.reply_text
    assert await outcomes(small + more) == {"Confirmation": 100}
    assert broker.count(queue) == 101


@aio
async def test_many_tasks_share_one_publisher(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    tasks, per_task = 30, 100
    async with AsyncPublisher(amqp_url, max_in_flight=500) as publisher:

        async def work(k: int) -> list[Confirmation]:
            done = []
            for i in range(per_task):
                if i % 4 == 0:  # a mix: some wait for each confirm, some stream
                    done.append(await publisher.publish_and_wait("", queue, b"%d-%d" % (k, i)))
                else:
                    done.append(await (await publisher.publish("", queue, b"%d-%d" % (k, i))))
            return done

        results = await asyncio.gather(*(work(k) for k in range(tasks)))
        assert await publisher.flush(timeout=60) == 0
        assert publisher.in_flight == 0
    assert sum(len(r) for r in results) == tasks * per_task
    bodies = [body for _, body in broker.drain(queue)]
    expected = sorted(b"%d-%d" % (k, i) for k in range(tasks) for i in range(per_task))
    assert sorted(bodies) == expected
    for k in range(tasks):  # each task's messages keep their order
        mine = [b for b in bodies if b.startswith(b"%d-" % k)]
        assert mine == [b"%d-%d" % (k, i) for i in range(per_task)]


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (("", "q", "text"), {}, "body"),
        (("", "q", None), {}, "body"),
        (("", "q", 42), {}, "body"),
        (("", "r" * 256, b"x"), {}, "routing_key"),
        (("é" * 128, "q", b"x"), {}, "exchange"),
        (("", "q", b"x"), {"headers": {"bad": object()}}, "headers['bad']"),
        (("", "q", b"x"), {"headers": {"big": 2**64}}, "headers['big']"),
        (("", "q", b"x"), {"headers": {"s": {1, 2}}}, "headers['s']"),
        (("", "q", b"x"), {"colour": "red"}, "colour"),
        (("", "q", b"x"), {"priority": 300}, "priority"),
        (("", "q", b"x"), {"expiration": "soon"}, "expiration"),
        (("", "q", b"x"), {"delivery_mode": 3}, "delivery_mode"),
        (("", "q", b"x"), {"message_id": "m" * 300}, "message_id"),
    ],
)
@aio
async def test_bad_input_fails_fast_and_disturbs_nothing(
    amqp_url: str, broker: BrokerAdmin, args: tuple[Any, ...], kwargs: dict[str, Any], field: str
) -> None:
    queue = broker.queue()
    async with AsyncPublisher(amqp_url) as publisher:
        first = await publisher.publish("", queue, b"before")
        with pytest.raises(InvalidMessage) as info:
            await publisher.publish(*args, **kwargs)
        assert info.value.field == field
        assert field.split("[", maxsplit=1)[0] in str(info.value)
        second = await publisher.publish("", queue, b"after")
        await publisher.flush(timeout=10)
        assert publisher.in_flight == 0
    assert first.result().attempts == 1 and second.result().attempts == 1
    assert [body for _, body in broker.drain(queue)] == [b"before", b"after"]


@pytest.mark.parametrize(
    "url",
    [
        f"http://guest:s3cret@127.0.0.1:{AMQP_DEFAULT_PORT}/",
        f"127.0.0.1:{AMQP_DEFAULT_PORT}",
        "amqp://guest:s3cret@127.0.0.1:99999/",
        "amqp://guest:s3cret@/vhost",
        "",
    ],
)
def test_malformed_url_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        AsyncPublisher(url)
    assert "s3cret" not in str(info.value)


@aio
async def test_wrong_credentials_fail_connect_fast_without_retry(amqp_url: str) -> None:
    url = amqp_url.replace("guest:guest", "guest:n0t-the-passw0rd")
    publisher = AsyncPublisher(url)
    assert "n0t-the-passw0rd" not in repr(publisher)
    started = time.monotonic()
    with pytest.raises(AuthenticationFailed) as info:
        await publisher.connect()
    assert time.monotonic() - started < 5  # not retried under the connect policy
    assert "n0t-the-passw0rd" not in str(info.value)
    assert not info.value.retriable
    await publisher.aclose()
    with pytest.raises(PublisherClosed):
        await publisher.publish("", "q", b"x")


@aio
async def test_missing_vhost_fails_connect_without_retry(amqp_url: str) -> None:
    url = amqp_url.rsplit("/", 1)[0] + "/" + unique("no-such-vhost")
    publisher = AsyncPublisher(url)
    with pytest.raises(AuthenticationFailed, match="virtual host"):
        await publisher.connect()
    await publisher.aclose()


def test_unknown_option_is_a_configuration_error(amqp_url: str) -> None:
    with pytest.raises(ConfigurationError, match="max_inflight"):
        AsyncPublisher(amqp_url, max_inflight=10)


@aio
async def test_declare_mismatch_raises_and_publisher_goes_on(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue(durable=True)
    async with AsyncPublisher(amqp_url) as publisher:
        inflight = [await publisher.publish("", queue, b"%d" % i) for i in range(100)]
        with pytest.raises(PreconditionFailed):
            await publisher.declare_queue(queue, durable=False)  # exists as durable: 406
        await publisher.flush(timeout=10)
        assert (await publisher.publish_and_wait("", queue, b"after")).attempts == 1
    assert await outcomes(inflight) == {"Confirmation": 100}
    assert broker.count(queue) == 101


@aio
async def test_declarations_work_and_route(amqp_url: str, broker: BrokerAdmin) -> None:
    exchange, queue = unique("x"), unique("q")
    try:
        async with AsyncPublisher(amqp_url) as publisher:
            await publisher.declare_exchange(exchange, "topic", auto_delete=False)
            assert await publisher.declare_queue(queue) == queue
            await publisher.bind_queue(queue, exchange, "a.*")
            confirmation = await publisher.publish_and_wait(exchange, "a.b", b"x", mandatory=True)
        assert confirmation.attempts == 1
        assert broker.count(queue) == 1
    finally:
        broker.channel.queue_delete(queue)
        broker.channel.exchange_delete(exchange)


@aio
async def test_delivery_timeout_bounds_a_stalled_link(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    async with AsyncPublisher(proxy.url(), delivery_timeout=1.0, heartbeat=0) as publisher:
        assert (await publisher.publish_and_wait("", queue, b"ok")).attempts == 1
        proxy.stall()
        started = time.monotonic()
        futures = [await publisher.publish("", queue, b"%d" % i) for i in range(10)]
        assert await publisher.flush(timeout=10) == 0
        elapsed = time.monotonic() - started
        proxy.resume()
    assert 0.9 <= elapsed < 3
    assert await outcomes(futures) == {"DeliveryTimeout": 10}
    error = futures[0].exception()
    assert isinstance(error, DeliveryTimeout) and error.timeout == 1.0


@aio
async def test_full_window_raises_publish_timeout(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    async with AsyncPublisher(
        proxy.url(), max_in_flight=2, publish_timeout=0.5, heartbeat=0
    ) as publisher:
        proxy.stall()
        held = [await publisher.publish("", queue, b"1"), await publisher.publish("", queue, b"2")]
        started = time.monotonic()
        with pytest.raises(PublishTimeout, match="max_in_flight=2"):
            await publisher.publish("", queue, b"3")
        assert 0.4 <= time.monotonic() - started < 2
        proxy.resume()
        assert await publisher.flush(timeout=10) == 0
    assert await outcomes(held) == {"Confirmation": 2}


@aio
async def test_close_resolves_every_future(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    publisher = await AsyncPublisher(proxy.url(), heartbeat=0).connect()
    proxy.stall()
    futures = [await publisher.publish("", queue, b"%d" % i) for i in range(25)]
    assert await publisher.flush(timeout=0.2) == 25
    started = time.monotonic()
    assert await publisher.aclose(timeout=0.2) == 25
    assert time.monotonic() - started < 8  # the close handshake with a stalled peer is bounded
    assert all(f.done() for f in futures)
    assert await outcomes(futures) == {"PublisherClosed": 25}
    with pytest.raises(PublisherClosed):
        await publisher.publish("", queue, b"late")
    proxy.resume()
