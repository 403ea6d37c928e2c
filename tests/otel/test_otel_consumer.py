"""The consumer's telemetry: one CONSUMER span per message continuing the publisher's trace,
and the consume metrics (docs/consumer.md, "Observability")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from reliable_amqp import Consumer, Delivery, Publisher, RetryPolicy
from support.broker import BrokerAdmin
from support.otel import Otel, make_otel, points_by

pytestmark = pytest.mark.broker

POLICY = RetryPolicy(max_attempts=2, initial_delay=0.1, jitter=0.0)


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = make_otel()
    yield made
    made.shutdown()


def test_each_message_gets_a_consumer_span_in_the_publishers_trace(
    amqp_url: str, broker: BrokerAdmin, otel: Otel
) -> None:
    queue = broker.queue()
    with Publisher(amqp_url, **otel.options) as publisher:
        publisher.publish("", queue, b"ok", message_id="good")
        publisher.publish("", queue, b"bad", message_id="bad")
        assert publisher.flush(30) == 0
    producer = {
        s.attributes["messaging.message.id"]: s
        for s in otel.finished()
        if s.kind == SpanKind.PRODUCER
    }
    consumer = Consumer(amqp_url, queue, redelivery=POLICY, **otel.options)
    seen: list[str | None] = []

    def handler(delivery: Delivery) -> None:
        seen.append(delivery.message_id)
        if seen.count("bad") == 2 and "good" in seen:
            consumer.stop()  # the last call: the stop waits for its dead letter's confirm
        if delivery.message_id == "bad":
            raise ValueError("no")

    try:
        consumer.run(handler)
    finally:
        ch = broker._ch()
        ch.queue_delete(f"{queue}.dead")
        ch.queue_delete(f"{queue}.retry.100ms")
    spans = [s for s in otel.finished() if s.kind == SpanKind.CONSUMER]
    assert len(spans) == 3  # good once, bad twice (then dead-lettered)
    for span in spans:
        message_id = span.attributes["messaging.message.id"]
        assert span.name == f"process {queue}"
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.destination.name"] == queue
        # continues the publisher's trace: same trace id
        assert span.context.trace_id == producer[message_id].context.trace_id
    failed = [s for s in spans if s.attributes["messaging.message.id"] == "bad"]
    assert all(s.status.status_code == StatusCode.ERROR for s in failed)
    points = points_by(otel.metrics()["reliable_amqp.consumer.messages"], "outcome")
    assert points["handled"].value == 1
    assert points["retried"].value == 1
    assert points["dead_lettered"].value == 1
    assert otel.metrics()["messaging.process.duration"]
