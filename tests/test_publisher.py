"""The sync Publisher against the real local broker: the delivery contract, case by case."""

from __future__ import annotations

import datetime as dt
import threading
import time
from concurrent.futures import Future
from typing import Any

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
    MessageProperties,
    MessageRejected,
    MessageReturned,
    OperationTimeout,
    OutgoingMessage,
    PreconditionFailed,
    Publisher,
    PublisherClosed,
    PublishTimeout,
    RetryPolicy,
)
from reliable_amqp._core.builder import build_message
from support.broker import AMQP_DEFAULT_PORT, BrokerAdmin, unique

pytestmark = pytest.mark.broker

PublisherClass = Any


@pytest.fixture(params=["sync", "async"])
def publisher_class(request: pytest.FixtureRequest) -> PublisherClass:
    """Every case runs against Publisher and against AsyncPublisher (through a blocking facade
    that drives it on an event loop thread), so both honour one contract."""
    if request.param == "sync":
        return Publisher
    from support.aio_blocking import BlockingAsyncPublisher

    return BlockingAsyncPublisher


FAST_NACKS = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.05, jitter=0.0)


def outcomes(futures: list[Future[Confirmation]], timeout: float = 30) -> dict[str, int]:
    """Count futures by outcome class name (every future must be resolved)."""
    counts: dict[str, int] = {}
    for f in futures:
        exc = f.exception(timeout)
        name = "Confirmation" if exc is None else type(exc).__name__
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_every_message_confirmed_and_in_the_queue(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    n = 3000
    with publisher_class(amqp_url) as publisher:
        futures = [publisher.publish("", queue, b"m%05d" % i) for i in range(n)]
        assert publisher.flush(timeout=30) == 0
    results = [f.result(0) for f in futures]
    assert all(r.attempts == 1 for r in results)
    assert len({r.message_id for r in results}) == n
    assert broker.count(queue) == n
    received = broker.drain(queue)
    assert [body for _, body in received] == [b"m%05d" % i for i in range(n)]
    assert [p.message_id for p, _ in received] == [r.message_id for r in results]
    assert {p.delivery_mode for p, _ in received} == {2}  # persistent by default


def test_a_confirmed_sync_future_gives_its_confirmation_to_every_reader(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    """A confirm settles the sync future with the entry's raw outcome; the Confirmation is built
    when read, once, and every way of reading a concurrent Future gets it."""
    import asyncio
    import concurrent.futures

    queue = broker.queue()
    seen: list[object] = []
    with Publisher(amqp_url) as publisher:
        futures = publisher.publish_many("", queue, [b"a", b"b", b"c"])
        futures[0].add_done_callback(lambda f: seen.append(f.result()))
        assert publisher.flush(timeout=30) == 0
    done, pending = concurrent.futures.wait(futures, timeout=5)
    assert len(done) == 3 and not pending
    assert len(list(concurrent.futures.as_completed(futures, timeout=5))) == 3
    received = [p.message_id for p, _ in broker.drain(queue)]
    for future, message_id in zip(futures, received, strict=True):
        result = future.result(0)
        assert type(result) is Confirmation and result == Confirmation(message_id, 1)
        assert future.result(0) is result  # built once
        assert future.exception(0) is None
        assert "finished" in repr(future)

    async def through_asyncio() -> object:
        return await asyncio.wrap_future(futures[1])

    assert asyncio.run(through_asyncio()) == Confirmation(received[1], 1)
    assert seen == [Confirmation(received[0], 1)]


def test_publish_many_in_batches_every_message_in_order_with_its_own_id(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    n, batch = 3000, 700  # batches end mid-window and a call spans more than the window
    with publisher_class(amqp_url, max_in_flight=1000) as publisher:
        futures = []
        for start in range(0, n, batch):
            bodies = [b"m%05d" % i for i in range(start, min(n, start + batch))]
            futures += publisher.publish_many("", queue, bodies, content_type="text/plain")
        assert publisher.flush(timeout=30) == 0
    results = [f.result(0) for f in futures]
    assert all(r.attempts == 1 for r in results) and len({r.message_id for r in results}) == n
    received = broker.drain(queue)
    assert [body for _, body in received] == [b"m%05d" % i for i in range(n)]
    assert [p.message_id for p, _ in received] == [r.message_id for r in results]
    assert {(p.content_type, p.delivery_mode) for p, _ in received} == {("text/plain", 2)}


def test_publish_many_takes_the_callers_ids_one_per_body(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    with publisher_class(amqp_url) as publisher:
        ids = [f"order-{i}" for i in range(500)]
        futures = publisher.publish_many("", queue, [b"x"] * 500, message_ids=iter(ids))
        # checked before anything is sent: a wrong count, a bad id (named), the keyword
        bad: list[tuple[dict[str, Any], str]] = [
            ({"message_ids": ["a", "b"]}, "message_ids"),
            ({"message_ids": ["a", "", "c"]}, "message_ids[1]"),
            ({"message_ids": ["a", None, "c"]}, "message_ids[1]"),
            ({"message_ids": ["a", "b", "é" * 200]}, "message_ids[2]"),
            ({"message_ids": "abc"}, "message_ids"),
            ({"message_id": "a"}, "message_id"),
        ]
        for kwargs, field in bad:
            with pytest.raises(InvalidMessage) as raised:
                publisher.publish_many("", queue, [b"1", b"2", b"3"], **kwargs)
            assert raised.value.field == field, raised.value
        assert publisher.flush(timeout=30) == 0
    assert [f.result(0).message_id for f in futures] == ids
    assert [p.message_id for p, _ in broker.drain(queue)] == ids


def test_properties_and_headers_arrive_intact(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue(x_max_priority=5)
    with publisher_class(amqp_url) as publisher:
        confirmation = publisher.publish_and_wait(
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
    assert props.headers["tenant"] == b"acme" or props.headers["tenant"] == "acme"
    assert props.headers["n"] == 7
    assert props.headers["nested"] == {"ok": True}


def test_nacks_are_retried_then_fail(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    # A full queue with reject-publish makes RabbitMQ nack for real.
    queue = broker.queue(x_max_length=5, x_overflow="reject-publish")
    with publisher_class(amqp_url, nack_policy=FAST_NACKS) as publisher:
        futures = [publisher.publish("", queue, b"%d" % i) for i in range(20)]
        assert publisher.flush(timeout=30) == 0
    assert outcomes(futures) == {"Confirmation": 5, "MessageNacked": 15}
    nacked = [f.exception() for f in futures if f.exception() is not None]
    assert all(isinstance(e, MessageNacked) and e.attempts == 3 for e in nacked)
    assert {e.message.body for e in nacked if e is not None}.isdisjoint(
        {body for _, body in broker.drain(queue)}
    )


def test_nacked_messages_succeed_once_the_queue_has_room(
    amqp_url: str,
    broker: BrokerAdmin,
    publisher_class: PublisherClass,
) -> None:
    queue = broker.queue(x_max_length=5, x_overflow="reject-publish")
    patient = RetryPolicy(max_attempts=50, initial_delay=0.02, max_delay=0.2, jitter=0.01)
    received: list[bytes] = []
    full = threading.Event()

    def consume() -> None:
        # A push consumer with automatic acks: nothing it was sent goes back to the queue. One
        # whose cancel requeues what it had prefetched (as BrokerAdmin.drain does) makes LavinMQ
        # drop from the head of the full queue, after the confirm (docs/brokers.md).
        if not full.wait(30):
            return
        connection = pika.BlockingConnection(pika.URLParameters(broker.url))
        try:
            channel = connection.channel()
            channel.basic_consume(queue, lambda _c, _m, _p, body: received.append(body), True)
            deadline = time.monotonic() + 90
            while len(received) < 60 and time.monotonic() < deadline:
                connection.process_data_events(0.05)
        finally:
            connection.close()

    consumer = threading.Thread(target=consume)
    consumer.start()
    try:
        with publisher_class(amqp_url, nack_policy=patient) as publisher:
            futures = [publisher.publish("", queue, b"%03d" % i) for i in range(60)]
            deadline = time.monotonic() + 30
            while broker.count(queue) < 5 and time.monotonic() < deadline:
                time.sleep(0.01)  # polling the queue's depth: the moment it is full
            full.set()  # now nacks are under way; the consumer makes room
            assert publisher.flush(timeout=60) == 0
    finally:
        full.set()
        consumer.join()
    assert outcomes(futures) == {"Confirmation": 60}
    assert max(f.result().attempts for f in futures) > 1  # some really were nacked first
    assert sorted(received) == [b"%03d" % i for i in range(60)]


def test_unroutable_mandatory_messages_are_returned(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    exchange = broker.exchange()
    queue = broker.queue()
    broker.bind(queue, exchange, "routed")
    with publisher_class(amqp_url) as publisher:
        # The same message_id on both: returns are matched per attempt, not by the user's id.
        routed = [
            publisher.publish(exchange, "routed", b"r", mandatory=True, message_id="same")
            for _ in range(10)
        ]
        lost = [
            publisher.publish(exchange, "nowhere", b"l", mandatory=True, message_id="same")
            for _ in range(10)
        ]
        # mandatory by default: with generated ids, returns are matched by message_id
        default = [publisher.publish(exchange, "nowhere", b"d") for _ in range(10)]
        default_routed = [publisher.publish(exchange, "routed", b"d") for _ in range(10)]
        # opted out: dropped by the broker, and acked
        unchecked = publisher.publish(exchange, "nowhere", b"u", mandatory=False)
        publisher.flush(timeout=30)
    assert outcomes(routed) == {"Confirmation": 10}
    assert outcomes(lost) == {"MessageReturned": 10}
    assert outcomes(default) == {"MessageReturned": 10}
    assert outcomes(default_routed) == {"Confirmation": 10}
    error = lost[0].exception()
    assert isinstance(error, MessageReturned)
    assert error.reply_code == 312 and "NO_ROUTE" in error.reply_text
    assert error.message.routing_key == "nowhere"
    assert unchecked.result().attempts == 1
    assert broker.count(queue) == 20


@pytest.mark.parametrize("routed_by", ["CC", "BCC", "BCC alone", "headers exchange"])
def test_messages_alike_but_for_their_headers_each_get_their_own_outcome(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass, routed_by: str
) -> None:
    # Headers route too: with the same id, route and body, the one whose headers route it is
    # routed and the other returned (the broker test of publish() inputs found the return
    # settled on the routed one, with CC). Headers of other types ride along, to be compared
    # as the broker's client library decodes them: pika truncates the double to 5, pamqp reads
    # the stamp after 2106 as milliseconds (CI found each settling the return on the wrong one).
    queue = broker.queue()
    common = {
        "at": dt.datetime(2026, 1, 2, 3, 4, 5, 600000),
        "raw": b"\xff\x00",
        "n": 7,
        "f": 5.5,
        "late": dt.datetime(2500, 1, 1, tzinfo=dt.timezone.utc),
    }
    exchange, routing_key = "", "nowhere"
    if routed_by == "headers exchange":
        exchange, routing_key = broker.exchange(kind="headers"), ""
        broker.bind(queue, exchange, "", {"x-match": "all", "route": "yes"})
        routed, returned = {"route": "yes", **common}, {"route": "no", **common}
    elif routed_by == "BCC alone":
        # RabbitMQ removes BCC from what it returns: the two come back alike (CI found the
        # return settled on the routed one); the attempt header tells them apart
        routed = {"BCC": [queue], **common}
        returned = {"BCC": ["ra-test-nowhere"], **common}
    else:
        routed, returned = {routed_by: [queue], **common}, common
    with publisher_class(amqp_url) as publisher:
        futures = []
        for _ in range(5):
            for headers in (routed, returned):
                futures.append(
                    publisher.publish(
                        exchange, routing_key, b"same", message_id="same", headers=headers
                    )
                )
        publisher.flush(timeout=30)
    assert [type(f.exception()).__name__ for f in futures] == ["NoneType", "MessageReturned"] * 5
    assert broker.count(queue) == 5


def test_publish_message_sends_a_message_made_beforehand(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    # what users holding an OutgoingMessage need, and the CLI's --failed replay: the message
    # as it was made (its id kept), checked as publish() checks its arguments
    queue = broker.queue()
    made = OutgoingMessage(
        "",
        queue,
        b"again",
        MessageProperties(message_id="order-7", headers={"n": 1}, priority=3, delivery_mode=1),
        mandatory=True,
    )
    with publisher_class(amqp_url) as publisher:
        first = publisher.publish_message(made)
        lost = publisher.publish("", "ra-test-nowhere", b"lost", message_id="lost-1")
        publisher.flush(timeout=30)
        returned = lost.exception(30)
        assert isinstance(returned, MessageReturned)
        # the message an error carries goes out again as it was
        again = publisher.publish_message(returned.message.replace(routing_key=queue))
        assert first.result(30).message_id == "order-7"
        assert again.result(30).message_id == "lost-1"
        with pytest.raises(InvalidMessage, match="message") as info:
            publisher.publish_message(b"not a message")
        assert info.value.field == "message"
        bad = OutgoingMessage("", queue, b"x", MessageProperties(priority=300))
        with pytest.raises(InvalidMessage) as info:
            publisher.publish_message(bad)
        assert info.value.field == "priority"
        # checked by build_message already, but not against this publisher: its user
        other_user = build_message("", queue, b"x", properties={"user_id": "someone-else"})
        with pytest.raises(InvalidMessage) as info:
            publisher.publish_message(other_user)
        assert info.value.field == "user_id"
    (props, body), (props2, body2) = broker.drain(queue)
    assert (body, props.message_id, props.priority, props.delivery_mode) == (
        b"again",
        "order-7",
        3,
        1,
    )
    assert props.headers == {"n": 1}
    assert (body2, props2.message_id) == (b"lost", "lost-1")


def test_a_publisher_may_opt_out_of_mandatory(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    exchange = broker.exchange()
    with publisher_class(amqp_url, mandatory=False) as publisher:
        dropped = [publisher.publish(exchange, "nowhere", b"x") for _ in range(5)]
        returned = publisher.publish(exchange, "nowhere", b"y", mandatory=True)
        publisher.flush(timeout=30)
    assert outcomes(dropped) == {"Confirmation": 5}
    assert outcomes([returned]) == {"MessageReturned": 1}


def test_missing_exchange_fails_only_that_message(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    missing = unique("no-such-exchange")
    with publisher_class(amqp_url) as publisher:
        before = [publisher.publish("", queue, b"b%03d" % i) for i in range(200)]
        bad = publisher.publish(missing, "rk", b"nowhere")
        after = [publisher.publish("", queue, b"a%03d" % i) for i in range(200)]
        publisher.flush(timeout=30)
        later = publisher.publish_and_wait("", queue, b"later")  # still usable
    error = bad.exception()
    assert isinstance(error, MessageRejected)
    assert error.reply_code == 404 and missing in error.reply_text
    assert error.message.exchange == missing
    assert outcomes(before + after) == {"Confirmation": 400}
    assert later.attempts == 1
    # At least once: messages the broker had queued but not yet confirmed when the channel
    # closed were republished; each duplicate carries its original's message_id.
    received = broker.drain(queue)
    expected = {b"b%03d" % i for i in range(200)} | {b"a%03d" % i for i in range(200)} | {b"later"}
    assert {body for _, body in received} == expected
    ids = {f.result().message_id: f for f in before + after}
    for props, body in received:
        if body != b"later":
            assert ids[props.message_id].result().message_id == props.message_id
    by_body: dict[bytes, set[str]] = {}
    for props, body in received:
        by_body.setdefault(body, set()).add(props.message_id)
    assert all(len(mids) == 1 for mids in by_body.values())


@pytest.mark.slow
def test_oversize_body_is_rejected_and_others_go_on(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    huge = b"\0" * (128 * 1024 * 1024 + 1)  # RabbitMQ's default max_message_size + 1
    with publisher_class(amqp_url) as publisher:
        small = [publisher.publish("", queue, b"s%d" % i) for i in range(50)]
        big = publisher.publish("", queue, huge)
        more = [publisher.publish("", queue, b"t%d" % i) for i in range(50)]
        publisher.flush(timeout=60)
        assert publisher.publish_and_wait("", queue, b"after").attempts == 1
    error = big.exception()
    assert isinstance(error, MessageRejected)
    assert error.reply_code == 406 and "size" in error.reply_text
    assert outcomes(small + more) == {"Confirmation": 100}
    assert broker.count(queue) == 101


def test_many_threads_share_one_publisher(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue()
    threads, per_thread = 8, 1500
    results: list[list[Future[Confirmation]]] = [[] for _ in range(threads)]
    with publisher_class(amqp_url, max_in_flight=500) as publisher:

        def work(k: int) -> None:
            for i in range(per_thread):
                results[k].append(publisher.publish("", queue, b"%d-%d" % (k, i)))

        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert publisher.flush(timeout=60) == 0
    futures = [f for per in results for f in per]
    assert outcomes(futures) == {"Confirmation": threads * per_thread}
    bodies = [body for _, body in broker.drain(queue)]
    assert sorted(bodies) == sorted(
        b"%d-%d" % (k, i) for k in range(threads) for i in range(per_thread)
    )
    for k in range(threads):  # each thread's messages keep their order
        mine = [b for b in bodies if b.startswith(b"%d-" % k)]
        assert mine == [b"%d-%d" % (k, i) for i in range(per_thread)]


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (("", "q", "text"), {}, "body"),
        (("", "q", None), {}, "body"),
        (("", "q", 42), {}, "body"),
        (("", "r" * 256, b"x"), {}, "routing_key"),
        (("é" * 128, "q", b"x"), {}, "exchange"),
        (("", "q\ud800", b"x"), {}, "routing_key"),
        (("", "q", b"x"), {"headers": {"k": "lone \udc80"}}, "headers['k']"),
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
def test_bad_input_fails_fast_and_disturbs_nothing(  # noqa: PLR0917 (fixtures + parameters)
    amqp_url: str,
    broker: BrokerAdmin,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    field: str,
    publisher_class: PublisherClass,
) -> None:
    queue = broker.queue()
    with publisher_class(amqp_url) as publisher:
        first = publisher.publish("", queue, b"before")
        with pytest.raises(InvalidMessage) as info:
            publisher.publish(*args, **kwargs)
        assert info.value.field == field
        assert field.split("[", maxsplit=1)[0] in str(info.value)
        second = publisher.publish("", queue, b"after")
        publisher.flush(timeout=10)
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
def test_malformed_url_is_a_configuration_error(url: str, publisher_class: PublisherClass) -> None:
    with pytest.raises(ConfigurationError) as info:
        publisher_class(url)
    assert "s3cret" not in str(info.value)


def test_wrong_credentials_fail_connect_fast_without_retry(
    amqp_url: str, publisher_class: PublisherClass
) -> None:
    url = amqp_url.replace("guest:guest", "guest:n0t-the-passw0rd")
    publisher = publisher_class(url)
    assert "n0t-the-passw0rd" not in repr(publisher)
    started = time.monotonic()
    with pytest.raises(AuthenticationFailed) as info:
        publisher.connect()
    assert time.monotonic() - started < 5  # not retried under the connect policy
    assert "n0t-the-passw0rd" not in str(info.value)
    assert not info.value.retriable
    publisher.close()
    with pytest.raises(PublisherClosed):
        publisher.publish("", "q", b"x")


def test_unknown_option_is_a_configuration_error(
    amqp_url: str, publisher_class: PublisherClass
) -> None:
    with pytest.raises(ConfigurationError, match="max_inflight"):
        publisher_class(amqp_url, max_inflight=10)


def test_declare_mismatch_raises_and_publisher_goes_on(
    amqp_url: str, broker: BrokerAdmin, publisher_class: PublisherClass
) -> None:
    queue = broker.queue(durable=True)
    with publisher_class(amqp_url) as publisher:
        inflight = [publisher.publish("", queue, b"%d" % i) for i in range(100)]
        with pytest.raises(PreconditionFailed):
            publisher.declare_queue(queue, durable=False)  # exists as durable: 406
        publisher.flush(timeout=10)
        assert publisher.publish_and_wait("", queue, b"after").attempts == 1
    assert outcomes(inflight) == {"Confirmation": 100}
    assert broker.count(queue) == 101


def test_delivery_timeout_bounds_a_stalled_link(
    amqp_url: str,
    broker: BrokerAdmin,
    make_proxy: ProxyFactory,
    publisher_class: PublisherClass,
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    publisher = publisher_class(proxy.url(), delivery_timeout=1.0, heartbeat=0)
    with publisher:
        assert publisher.publish_and_wait("", queue, b"ok").attempts == 1
        proxy.stall()
        started = time.monotonic()
        futures = [publisher.publish("", queue, b"%d" % i) for i in range(10)]
        assert publisher.flush(timeout=10) == 0
        elapsed = time.monotonic() - started
        proxy.resume()
    assert 0.9 <= elapsed < 3
    assert outcomes(futures) == {"DeliveryTimeout": 10}
    error = futures[0].exception()
    assert isinstance(error, DeliveryTimeout) and error.timeout == 1.0


def test_full_window_raises_publish_timeout(
    amqp_url: str,
    broker: BrokerAdmin,
    make_proxy: ProxyFactory,
    publisher_class: PublisherClass,
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    with publisher_class(
        proxy.url(), max_in_flight=2, publish_timeout=0.5, heartbeat=0
    ) as publisher:
        proxy.stall()
        held = [publisher.publish("", queue, b"1"), publisher.publish("", queue, b"2")]
        started = time.monotonic()
        with pytest.raises(PublishTimeout, match="max_in_flight=2"):
            publisher.publish("", queue, b"3")
        assert 0.4 <= time.monotonic() - started < 2
        proxy.resume()
        assert publisher.flush(timeout=10) == 0
    assert outcomes(held) == {"Confirmation": 2}


def test_close_resolves_every_future(
    amqp_url: str,
    broker: BrokerAdmin,
    make_proxy: ProxyFactory,
    publisher_class: PublisherClass,
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    publisher = publisher_class(proxy.url(), heartbeat=0).connect()
    proxy.stall()
    futures = [publisher.publish("", queue, b"%d" % i) for i in range(25)]
    assert publisher.flush(timeout=0.2) == 25
    assert publisher.close(timeout=0.2) == 25
    assert all(f.done() for f in futures)
    assert outcomes(futures) == {"PublisherClosed": 25}
    with pytest.raises(PublisherClosed):
        publisher.publish("", queue, b"late")


def test_a_declaration_that_timed_out_is_not_made_later(
    amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    late = unique("ra-test-late")
    proxy = make_proxy()
    with Publisher(proxy.url()) as publisher:
        proxy.refuse()
        proxy.cut()  # recovering: the declaration waits for a connection, then times out
        with pytest.raises(OperationTimeout):
            publisher.declare_queue(late, timeout=0.5)
        proxy.accept()
        publisher.publish("", queue, b"after").result(timeout=30)  # connected again
        publisher.flush(timeout=30)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
            connection.channel().queue_declare(late, passive=True)
        assert missing.value.reply_code == 404
    finally:
        connection.close()
    assert broker.count(queue) == 1
