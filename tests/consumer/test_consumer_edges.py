"""The consumer at its edges (issue 45): misuse is refused or loud, and never loses a message.

Each test reproduces a probe that lost, duplicated or hung on the code before it: a handler of
the wrong kind, a BaseException in an async handler, run() called twice, a handler that cancels
itself, a queue the broker refuses (missing, exclusive, a permission), a queue that cannot count
a crash loop, and an error that can never succeed. All against the real broker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pika
import pytest

from reliable_amqp import (
    AccessRefused,
    AsyncConsumer,
    Consumer,
    Delivery,
    MissingMessageId,
    QueueNotFound,
    ResourceLocked,
    RetryPolicy,
    WrongHandlerKind,
)
from support.broker import BrokerAdmin, unique
from support.consumer import delete_queues, fill, running, side_queues, wait_until, warnings_logged

pytestmark = pytest.mark.broker

QUICK = RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=0.2, jitter=0.0)


@pytest.fixture
def queue(amqp_url: str, broker: BrokerAdmin) -> Iterator[str]:
    """A durable queue holding nothing yet; it and the consumer's own queues deleted after."""
    name = broker.queue(unique("c-edge"))
    yield name
    delete_queues(amqp_url, [name, *side_queues(name, QUICK)])


def counts(amqp_url: str, queue: str) -> tuple[int, int]:
    """(messages, consumers) of ``queue``: its ready messages once no consumer holds any."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ok = connection.channel().queue_declare(queue, passive=True).method
        return ok.message_count, ok.consumer_count
    finally:
        connection.close()


def all_back(amqp_url: str, queue: str, n: int) -> None:
    """Every one of ``n`` messages is back in ``queue``, held by no consumer."""
    wait_until(lambda: counts(amqp_url, queue) == (n, 0), 30, f"{n} messages back, no consumer")


# --- a handler of the wrong kind --------------------------------------------------------------


async def _async_handler(delivery: Delivery) -> None:
    raise AssertionError("never called")


def _generator_handler(delivery: Delivery) -> Iterator[None]:
    yield None


class _AsyncCallable:
    async def __call__(self, delivery: Delivery) -> None:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    "handler",
    [
        _async_handler,
        functools.partial(_async_handler),
        _AsyncCallable(),
        _generator_handler,
    ],
    ids=["async-def", "partial-of-async", "async-__call__", "generator"],
)
def test_consumer_refuses_a_handler_of_the_wrong_kind_before_consuming(
    amqp_url: str, queue: str, handler: Callable[[Delivery], Any]
) -> None:
    fill(amqp_url, queue, ["a", "b", "c"])
    consumer = Consumer(amqp_url, queue, redelivery=QUICK)
    with pytest.raises(WrongHandlerKind, match=r"AsyncConsumer|plain function"):
        consumer.run(handler)
    assert counts(amqp_url, queue) == (3, 0)  # nothing consumed, nothing acked


def test_a_plain_handler_returning_a_coroutine_ends_run_and_acks_nothing(
    amqp_url: str, queue: str, recwarn: pytest.WarningsRecorder
) -> None:
    """A lambda around an async function passes the up-front check; its first result shows
    what it is: run() raises, the message goes back, and no 'never awaited' warning."""
    fill(amqp_url, queue, ["a", "b", "c"])
    consumer = Consumer(amqp_url, queue, redelivery=QUICK)

    async def work(delivery: Delivery) -> None:
        raise AssertionError("never awaited by Consumer")

    with pytest.raises(WrongHandlerKind, match="use AsyncConsumer"):
        consumer.run(lambda d: work(d))  # noqa: PLW0108  (the lambda is the point)
    all_back(amqp_url, queue, 3)
    assert consumer.stats.handled == 0
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def _plain_handler(delivery: Delivery) -> None:
    raise AssertionError("a side effect AsyncConsumer must never run")


@pytest.mark.parametrize(
    "handler",
    [_plain_handler, functools.partial(_plain_handler), lambda d: None, _generator_handler],
    ids=["def", "partial", "lambda", "generator"],
)
def test_async_consumer_refuses_a_plain_handler_before_consuming(
    amqp_url: str, queue: str, handler: Callable[[Delivery], Any]
) -> None:
    fill(amqp_url, queue, ["a", "b", "c"])
    consumer = AsyncConsumer(amqp_url, queue, redelivery=QUICK)
    with pytest.raises(WrongHandlerKind, match=r"async def|plain function"):
        asyncio.run(consumer.run(handler))
    assert counts(amqp_url, queue) == (3, 0)


# --- BaseException in an async handler ----------------------------------------------------------

_SYSTEM_EXIT_CHILD = textwrap.dedent(
    """
    import asyncio, sys, threading, gc
    from reliable_amqp import AsyncConsumer, RetryPolicy

    url, queue = sys.argv[1], sys.argv[2]
    calls = []

    async def handler(delivery):
        calls.append(delivery.message_id)
        if len(calls) == 2:
            raise SystemExit(3)
        await asyncio.sleep(0)

    consumer = AsyncConsumer(url, queue, prefetch=10, concurrency=1,
                             redelivery=RetryPolicy(max_attempts=3, initial_delay=0.1,
                                                    max_delay=0.2, jitter=0.0))
    try:
        asyncio.run(consumer.run(handler))
    except SystemExit as exc:
        print("SYSTEM_EXIT", exc.code, flush=True)
    gc.collect()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("reliable-amqp")]
    print("THREADS", alive, flush=True)
    print("CALLS", len(calls), consumer.stats.handled, flush=True)
    """
)


def test_system_exit_in_an_async_handler_ends_run_and_gives_the_message_back(
    amqp_url: str, queue: str
) -> None:
    """Caught around asyncio.run, as a service's main would: the first message was handled
    (acked), the second one, whose handler raised, and the unstarted ones go back; the I/O
    threads and connections are closed; nothing is printed about closed loops or tasks."""
    fill(amqp_url, queue, [f"m{i}" for i in range(5)])
    done = subprocess.run(
        [sys.executable, "-c", _SYSTEM_EXIT_CHILD, amqp_url, queue],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "SYSTEM_EXIT 3" in done.stdout, (done.stdout, done.stderr)
    assert "THREADS []" in done.stdout, done.stdout
    assert "CALLS 2 1" in done.stdout, done.stdout
    for noise in ("Event loop is closed", "was destroyed but it is pending", "never awaited"):
        assert noise not in done.stderr, done.stderr
    all_back(amqp_url, queue, 4)


# --- run() twice -----------------------------------------------------------------------------


def test_run_called_again_after_it_returned_consumes_again(amqp_url: str, queue: str) -> None:
    consumer = Consumer(amqp_url, queue, prefetch=10, redelivery=QUICK)
    seen: list[str | None] = []
    for round_ in range(2):
        fill(amqp_url, queue, [f"r{round_}-{i}" for i in range(5)])
        want = 5 * (round_ + 1)
        with running(consumer, lambda d: seen.append(d.message_id)):
            wait_until(lambda: len(seen) == want, 30, f"run {round_ + 1}'s messages")  # noqa: B023
    assert seen == [f"r{r}-{i}" for r in range(2) for i in range(5)]
    assert counts(amqp_url, queue) == (0, 0)


def test_async_run_called_again_after_it_returned_consumes_again(amqp_url: str, queue: str) -> None:
    consumer = AsyncConsumer(amqp_url, queue, prefetch=10, concurrency=2, redelivery=QUICK)
    seen: list[str] = []

    async def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id or "")
        if len(seen) % 5 == 0:
            consumer.stop()

    async def main() -> None:
        for round_ in range(2):
            fill(amqp_url, queue, [f"r{round_}-{i}" for i in range(5)])
            await asyncio.wait_for(consumer.run(handler), 60)

    asyncio.run(main())
    assert sorted(seen) == sorted(f"r{r}-{i}" for r in range(2) for i in range(5))
    wait_until(lambda: counts(amqp_url, queue) == (0, 0), 30, "everything acked")


# --- a handler that cancels itself ------------------------------------------------------------


def test_a_handler_that_cancels_itself_is_a_failure_retried_not_a_cancel_of_run(
    amqp_url: str, queue: str, broker: BrokerAdmin
) -> None:
    fill(amqp_url, queue, ["a"])
    consumer = AsyncConsumer(amqp_url, queue, redelivery=QUICK)
    calls: list[int] = []

    async def handler(delivery: Delivery) -> None:
        calls.append(delivery.attempt)
        if delivery.attempt == 1:
            task = asyncio.ensure_future(asyncio.sleep(10))
            task.cancel()
            await task  # its CancelledError escapes the handler: nobody cancelled run()
        else:
            consumer.stop()

    asyncio.run(asyncio.wait_for(consumer.run(handler), 60))
    assert calls == [1, 2]
    assert consumer.stats.retried == 1 and consumer.stats.handled == 1
    assert broker.count(queue) == 0


def test_cancelling_run_is_a_cancel_that_gives_the_message_back(amqp_url: str, queue: str) -> None:
    fill(amqp_url, queue, ["a", "b"])
    consumer = AsyncConsumer(amqp_url, queue, redelivery=QUICK)
    started = threading.Event()

    async def handler(delivery: Delivery) -> None:
        started.set()
        await asyncio.sleep(60)

    async def main() -> None:
        task = asyncio.ensure_future(consumer.run(handler))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert consumer.stats.retried == 0 and consumer.stats.handled == 0
    all_back(amqp_url, queue, 2)


# --- queues the broker refuses ------------------------------------------------------------------


def test_a_missing_queue_ends_run_at_once_suggesting_declare(amqp_url: str) -> None:
    name = unique("c-missing")
    consumer = Consumer(amqp_url, name, redelivery=QUICK)
    started = time.monotonic()
    try:
        with pytest.raises(QueueNotFound, match="declare=True") as caught:
            consumer.run(lambda d: None)
    finally:
        delete_queues(amqp_url, [name, *side_queues(name, QUICK)])
    took = time.monotonic() - started
    assert name in str(caught.value)
    assert took < 30, f"a missing queue took {took:.1f} s to be reported"


def test_an_exclusive_queue_of_another_connection_ends_run_naming_it(amqp_url: str) -> None:
    owner = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        name = owner.channel().queue_declare(unique("c-excl"), exclusive=True).method.queue
        consumer = Consumer(amqp_url, name, redelivery=QUICK)
        with pytest.raises(ResourceLocked, match="exclusive to another connection"):
            consumer.run(lambda d: None)
    finally:
        owner.close()
        delete_queues(amqp_url, side_queues(name, QUICK))


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def limited_user(amqp_url: str) -> Iterator[Callable[[str, str, str], str]]:
    """``make(configure, write, read)``: a broker user with those permission patterns on '/'
    and its URL; deleted after."""
    users: list[str] = []

    def make(configure: str, write: str, read: str) -> str:
        user = unique("c-user")
        _ctl("add_user", user, "secret")
        users.append(user)
        _ctl("set_permissions", "-p", "/", user, configure, write, read)
        params = pika.URLParameters(amqp_url)
        return f"amqp://{user}:secret@{params.host}:{params.port}/%2F"

    yield make
    for user in users:
        _ctl("delete_user", user)


@pytest.mark.rabbitmq_only(reason="adds broker users with rabbitmqctl")
def test_a_missing_permission_names_the_permission_and_the_object(
    amqp_url: str, queue: str, limited_user: Callable[[str, str, str], str]
) -> None:
    # everything but configure on the consumer's own queues, which exist already
    delete_queues(amqp_url, side_queues(queue, QUICK))
    admin = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = admin.channel()
        channel.queue_declare(f"{queue}.dead", durable=True)
    finally:
        admin.close()
    url = limited_user(f"^{queue}$", ".*", ".*")
    with pytest.raises(AccessRefused) as caught:
        Consumer(url, queue, redelivery=QUICK).run(lambda d: None)
    text = str(caught.value)
    assert "'configure' permission on queue" in text and f"{queue}.dead" in text, text
    assert "even when it exists" in text and "rabbitmqctl set_permissions" in text, text

    # configure everywhere, but no read on the queue to consume
    url = limited_user(".*", ".*", f"^{queue}\\..*$")
    with pytest.raises(AccessRefused) as caught:
        Consumer(url, queue, redelivery=QUICK).run(lambda d: None)
    text = str(caught.value)
    assert f"'read' permission on queue '{queue}'" in text and "basic.consume" in text, text


# --- a queue that cannot count a crash loop -------------------------------------------------


def _uncounted(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [w for w in warnings_logged(caplog) if "no delivery count" in w]


def _product(amqp_url: str) -> str:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return str(connection._impl.server_properties.get("product", ""))
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("arguments", "counted"),
    [
        pytest.param(None, False, id="classic"),
        # RabbitMQ's quorum queues count every redelivery; LavinMQ 2.9 declares a classic queue
        # for x-queue-type=quorum and counts only with x-delivery-limit (issue 45 item 8)
        pytest.param({"x-queue-type": "quorum"}, None, id="quorum"),
        pytest.param({"x-queue-type": "quorum", "x-delivery-limit": 100}, True, id="limited"),
    ],
)
def test_a_declared_queue_that_cannot_count_a_crash_loop_is_said_once_at_start(
    amqp_url: str,
    caplog: pytest.LogCaptureFixture,
    arguments: dict[str, Any] | None,
    counted: bool | None,
) -> None:
    caplog.set_level(logging.INFO, logger="reliable_amqp")
    if counted is None:
        counted = _product(amqp_url) != "LavinMQ"
    name = unique("c-counted")
    try:
        consumer = Consumer(
            amqp_url, name, declare=True, queue_arguments=arguments, redelivery=QUICK
        )
        with running(consumer, lambda d: None):
            wait_until(consumer._core.io.consuming.is_set, 30, "the subscription")
        said = _uncounted(caplog)
        assert len(said) == (0 if counted else 1), said
        if not counted:
            assert "record_attempt" in said[0] and "x-delivery-limit" in said[0], said
    finally:
        delete_queues(amqp_url, [name, *side_queues(name, QUICK)])


def test_an_uncounted_redelivery_is_said_once(
    amqp_url: str, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A queue declared elsewhere: its first redelivery without x-delivery-count is the
    evidence (a consumer that died gave the messages back)."""
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    fill(amqp_url, queue, ["a", "b", "c"])
    grab = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = grab.channel()
    channel.basic_qos(prefetch_count=3)
    for _ in channel.consume(queue, inactivity_timeout=5):
        if channel.get_waiting_message_count() >= 2:
            break
    grab.close()  # unacked: the three come back redelivered, uncounted (a classic queue)
    consumer = Consumer(amqp_url, queue, redelivery=QUICK)
    seen: list[bool] = []
    with running(consumer, lambda d: seen.append(d.redelivered)):
        wait_until(lambda: len(seen) == 3, 30, "the three redeliveries")
    assert all(seen)
    assert len(_uncounted(caplog)) == 1, warnings_logged(caplog)


# --- errors that can never succeed ------------------------------------------------------------


def test_an_error_that_can_never_succeed_is_dead_lettered_without_retries(
    amqp_url: str, queue: str, broker: BrokerAdmin
) -> None:
    fill(amqp_url, queue, ["a"])
    consumer = Consumer(amqp_url, queue, redelivery=QUICK)
    calls: list[int] = []

    def handler(delivery: Delivery) -> None:
        calls.append(delivery.attempt)
        raise MissingMessageId("no message_id: the inbox cannot claim it")

    with running(consumer, handler):
        wait_until(lambda: consumer.stats.dead_lettered == 1, 30, "the dead letter")
    assert calls == [1] and consumer.stats.retried == 0
    dead = broker.drain(f"{queue}.dead")
    assert len(dead) == 1
    headers = dead[0][0].headers or {}
    assert any("MissingMessageId" in str(v) for v in headers.values()), headers
