"""Both publishers against the real broker, with the SDK's in-memory exporter and reader: a
PRODUCER span per message under the caller's span, its traceparent on the message, ERROR on
nacks and returns, exact counts, one duration point per message, a span across a reconnect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from harness.fixtures import ProxyFactory
from reliable_amqp import (
    AsyncPublisher,
    Confirmation,
    EventKind,
    MessageNacked,
    MessageReturned,
    Publisher,
    PublisherEvent,
    RetryPolicy,
)
from reliable_amqp._otel._metrics import (
    NACKS,
    OPERATION_DURATION,
    RECONNECTS,
    REPUBLISHED,
    RETURNED,
    SENT_MESSAGES,
)
from support.broker import AMQP_HOST, AMQP_PORT, BrokerAdmin
from support.otel import Otel, make_otel, points_by

pytestmark = [pytest.mark.broker]

BODY = b"twelve bytes"
NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture
def otel() -> Iterator[Otel]:
    found = make_otel()
    yield found
    found.shutdown()


def _outcomes(futures: list[Any]) -> list[Any]:
    """Each future's Confirmation or exception (they are all done)."""
    return [f.exception() or f.result() for f in futures]


def _publish_sync(url: str, otel: Otel, jobs: list[tuple[str, str, bool]], **options: Any) -> Any:
    """Publish ``(exchange, routing_key, mandatory)`` jobs (the last two through publish_many)
    under a span "caller"; returns (the caller's span context, outcomes)."""
    tracer = otel.tracer_provider.get_tracer("test")
    with Publisher(url, **otel.options, **options) as publisher:
        with tracer.start_as_current_span("caller") as caller:
            futures = [publisher.publish(x, rk, BODY, mandatory=m) for x, rk, m in jobs[:-2]]
            x, rk, m = jobs[-1]
            futures += publisher.publish_many(x, rk, [BODY, BODY], mandatory=m)
        assert publisher.flush(30) == 0
    return caller.get_span_context(), _outcomes(futures)


def _publish_async(url: str, otel: Otel, jobs: list[tuple[str, str, bool]], **options: Any) -> Any:
    tracer = otel.tracer_provider.get_tracer("test")

    async def main() -> Any:
        async with AsyncPublisher(url, **otel.options, **options) as publisher:
            with tracer.start_as_current_span("caller") as caller:
                futures = [
                    await publisher.publish(x, rk, BODY, mandatory=m) for x, rk, m in jobs[:-2]
                ]
                x, rk, m = jobs[-1]
                futures += await publisher.publish_many(x, rk, [BODY, BODY], mandatory=m)
            assert await publisher.flush(30) == 0
        return caller.get_span_context(), _outcomes(futures)

    return asyncio.run(main())


PUBLISHERS = {"sync": _publish_sync, "async": _publish_async}


@pytest.mark.parametrize("kind", list(PUBLISHERS))
def test_one_producer_span_per_message_under_the_callers_span(
    kind: str, otel: Otel, broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    caller, outcomes = PUBLISHERS[kind](amqp_url, otel, [("", queue, False)] * 12)
    assert all(isinstance(o, Confirmation) for o in outcomes)
    ids = {o.message_id for o in outcomes}

    spans = [s for s in otel.finished() if s.kind is SpanKind.PRODUCER]
    assert len(spans) == 12 and len({s.context.span_id for s in spans}) == 12
    by_id = {s.attributes["messaging.message.id"]: s for s in spans}
    assert set(by_id) == ids
    for span in spans:
        assert span.name == "publish amq.default"
        assert span.parent is not None and span.parent.span_id == caller.span_id
        assert span.context.trace_id == caller.trace_id
        assert span.status.status_code is StatusCode.UNSET
        assert {k: v for k, v in span.attributes.items() if k != "messaging.message.id"} == {
            "messaging.system": "rabbitmq",
            "messaging.operation.name": "publish",
            "messaging.operation.type": "send",
            "messaging.destination.name": "",
            "messaging.rabbitmq.destination.routing_key": queue,
            "messaging.message.body.size": 12,
            "server.address": AMQP_HOST,  # the broker the suite runs against
            "server.port": AMQP_PORT,
        }

    # a consumer continues the trace: each message's traceparent names its own span
    received = broker.drain(queue)
    assert len(received) == 12
    for props, body in received:
        assert body == BODY
        context = TraceContextTextMapPropagator().extract(dict(props.headers or {}))
        remote = trace.get_current_span(context).get_span_context()
        span = by_id[props.message_id]
        assert (remote.trace_id, remote.span_id) == (span.context.trace_id, span.context.span_id)

    metrics = otel.metrics()
    assert [p.value for p in metrics[SENT_MESSAGES]] == [12]
    assert sum(p.count for p in metrics[OPERATION_DURATION]) == 12


@pytest.mark.parametrize("kind", list(PUBLISHERS))
def test_nacks_and_returns_are_errors_and_every_message_is_counted(
    kind: str, otel: Otel, broker: BrokerAdmin, amqp_url: str
) -> None:
    full = broker.queue(x_max_length=5, x_overflow="reject-publish")
    open_queue = broker.queue()
    nowhere = f"{open_queue}-unbound"
    jobs = (
        [("", full, False)] * 8  # 5 fit, 3 nacked (no retries)
        + [("", nowhere, True)]  # unroutable and mandatory: returned
        + [("", open_queue, False)] * 3  # the last two through publish_many
    )
    _, outcomes = PUBLISHERS[kind](amqp_url, otel, jobs, nack_policy=NO_RETRY)
    kinds = [type(o).__name__ for o in outcomes]
    assert kinds.count("Confirmation") == 8, kinds
    assert kinds.count("MessageNacked") == 3 and kinds.count("MessageReturned") == 1

    spans = {s.attributes["messaging.message.id"]: s for s in otel.finished() if s.parent}
    assert len(spans) == 12
    for outcome in outcomes:
        message_id = outcome.message.message_id if not isinstance(outcome, Confirmation) else ""
        if isinstance(outcome, Confirmation):
            span = spans[outcome.message_id]
            assert span.status.status_code is StatusCode.UNSET
            assert "error.type" not in span.attributes
            continue
        span = spans[message_id]
        assert span.status.status_code is StatusCode.ERROR
        expected = "MessageNacked" if isinstance(outcome, MessageNacked) else "MessageReturned"
        assert isinstance(outcome, (MessageNacked, MessageReturned))
        assert span.attributes["error.type"] == expected

    metrics = otel.metrics()
    sent = points_by(metrics[SENT_MESSAGES], "error.type")
    assert {k: p.value for k, p in sent.items()} == {
        None: 8,
        "MessageNacked": 3,
        "MessageReturned": 1,
    }
    durations = points_by(metrics[OPERATION_DURATION], "error.type")
    assert {k: p.count for k, p in durations.items()} == {
        None: 8,
        "MessageNacked": 3,
        "MessageReturned": 1,
    }
    assert metrics[NACKS][0].value == 3
    assert metrics[RETURNED][0].value == 1


class _Events:
    def __init__(self) -> None:
        self.seen: list[PublisherEvent] = []

    def __call__(self, event: PublisherEvent) -> None:
        self.seen.append(event)

    def at(self, kind: EventKind) -> float:
        return next(e.at for e in self.seen if e.kind is kind)


def test_a_span_survives_a_reconnect(
    otel: Otel, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    events = _Events()
    publisher = Publisher(
        proxy.url(),
        **otel.options,
        on_event=events,
        connect_policy=RetryPolicy(max_attempts=None, initial_delay=0.05, deadline=30),
    )
    with publisher:
        assert publisher.flush(10) == 0
        proxy.stall()  # the message goes out, its confirm cannot come back
        future = publisher.publish("", queue, BODY)
        time.sleep(0.3)
        assert publisher.stats().in_flight == 1 and not future.done()
        cut_at = time.time_ns()
        proxy.cut()
        proxy.resume()
        confirmation = future.result(30)
    assert isinstance(confirmation, Confirmation) and confirmation.attempts == 2
    assert [e.kind for e in events.seen].count(EventKind.RECOVERED) == 1

    (span,) = otel.finished()
    assert span.attributes["messaging.message.id"] == confirmation.message_id
    assert [e.name for e in span.events] == ["republish"]
    assert span.events[0].attributes == {"reliable_amqp.attempts": 1}
    assert span.status.status_code is StatusCode.UNSET
    assert span.start_time < cut_at < span.events[0].timestamp < span.end_time
    assert broker.count(queue) == 1

    metrics = otel.metrics()
    assert metrics[REPUBLISHED][0].value == 1
    assert metrics[RECONNECTS][0].value == 1
    assert [p.value for p in metrics[SENT_MESSAGES]] == [1]


def test_a_span_survives_a_reconnect_async(
    otel: Otel, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    events = _Events()

    async def main() -> tuple[Confirmation, int]:
        publisher = AsyncPublisher(
            proxy.url(),
            **otel.options,
            on_event=events,
            connect_policy=RetryPolicy(max_attempts=None, initial_delay=0.05, deadline=30),
        )
        async with publisher:
            proxy.stall()
            future = await publisher.publish("", queue, BODY)
            await asyncio.sleep(0.3)
            assert publisher.stats().in_flight == 1 and not future.done()
            cut_at = time.time_ns()
            proxy.cut()
            proxy.resume()
            confirmation = await asyncio.wait_for(future, 30)
        return confirmation, cut_at

    confirmation, cut_at = asyncio.run(main())
    assert confirmation.attempts == 2
    (span,) = otel.finished()
    assert span.attributes["messaging.message.id"] == confirmation.message_id
    assert [e.name for e in span.events] == ["republish"]
    assert span.start_time < cut_at < span.events[0].timestamp < span.end_time
    assert broker.count(queue) == 1
    assert otel.metrics()[REPUBLISHED][0].value == 1
