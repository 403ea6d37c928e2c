"""OpenTelemetry: a span per message, its trace context on the message, the publisher's metrics.

The OpenTelemetry SDK is configured here with in-memory exporters, so the example can print what
a real exporter (OTLP to Jaeger or Tempo, Prometheus) would receive. It needs
``pip install '.[otel]' opentelemetry-sdk``:

1. Ten orders are published inside a span of the application ("handle-batch"). Each message
   gets a PRODUCER span, ``publish amq.default``, a child of that span, ended when the broker
   confirms the message.
2. A consumer reads one message back and continues the trace from its ``traceparent`` header.
3. A message to a full queue is nacked: its span has status ERROR and ``error.type``.
4. The metrics: ``messaging.client.sent.messages`` by outcome, the duration histogram, and the
   library's own counters.

Configure OpenTelemetry before the publisher connects: a publisher decides at ``connect()``
whether there is anything to record.
"""

from __future__ import annotations

import os
import uuid

import pika
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_amqp import MessageNacked, Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")

# The application's OpenTelemetry set-up (an OTLP exporter in real life: docs/observability.md).
spans = InMemorySpanExporter()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(tracer_provider)
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
tracer = trace.get_tracer("orders-service")


def main() -> None:
    orders = f"ra-example-otel-{uuid.uuid4().hex[:8]}"
    full = f"{orders}-full"
    with Publisher(URL, nack_policy={"max_attempts": 1}) as publisher:
        publisher.declare_queue(orders, auto_delete=False)
        publisher.declare_queue(full, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
        try:
            with tracer.start_as_current_span("handle-batch") as batch:
                for i in range(10):
                    publisher.publish(
                        "", orders, b'{"order": %d}' % i, content_type="application/json"
                    )
                nacked = publisher.publish("", full, b"no room")
            publisher.flush(30)
            report(batch, orders, nacked.exception())
        finally:
            delete(orders, full)


def report(batch: trace.Span, orders: str, nacked: BaseException | None) -> None:
    finished = spans.get_finished_spans()
    producers = [s for s in finished if s.kind is trace.SpanKind.PRODUCER]
    trace_id = batch.get_span_context().trace_id
    print(f"1. {len(producers)} PRODUCER spans in trace {trace_id:032x}:")
    confirmed = sorted(
        (s for s in producers if s.status.status_code is trace.StatusCode.UNSET),
        key=lambda s: s.start_time or 0,
    )
    for span in confirmed[:2]:
        attributes = dict(span.attributes or {})
        print(
            f"   {span.name}: message id {attributes['messaging.message.id']}, routing key "
            f"{attributes.get('messaging.rabbitmq.destination.routing_key')!r}, "
            f"{((span.end_time or 0) - (span.start_time or 0)) / 1e6:.1f} ms publish to confirm"
        )
    print("   ...")

    connection = pika.BlockingConnection(pika.URLParameters(URL))
    _, properties, body = connection.channel().basic_get(orders, auto_ack=True)
    connection.close()
    context = propagate.extract(properties.headers or {})  # what a consumer does
    with tracer.start_as_current_span(
        "process order", context=context, kind=trace.SpanKind.CONSUMER
    ) as consumer:
        parent = getattr(consumer, "parent", None)  # the SDK's span (the API's has no parent)
    producer = next(
        s
        for s in producers
        if (s.attributes or {}).get("messaging.message.id") == properties.message_id
    )
    assert parent is not None and parent.span_id == producer.context.span_id
    print(f"2. a consumer read {body!r}: traceparent {properties.headers['traceparent']}")
    print(
        f"   its span continues trace {consumer.get_span_context().trace_id:032x} "
        f"under the message's span {parent.span_id:016x}"
    )

    failed = next(s for s in producers if s.status.status_code is trace.StatusCode.ERROR)
    assert isinstance(nacked, MessageNacked)
    print(
        f"3. {failed.name}: status {failed.status.status_code.name}, "
        f"error.type {(failed.attributes or {}).get('error.type')} ({nacked})"
    )

    print("4. metrics:")
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    error = dict(point.attributes or {}).get("error.type")
                    value = getattr(point, "value", None)
                    shown = (
                        f"count {getattr(point, 'count', 0)}, sum {getattr(point, 'sum', 0):.3f} s"
                        if value is None
                        else f"{value:g}"
                    )
                    print(f"   {metric.name}{f' [error.type={error}]' if error else ''}: {shown}")


def delete(*queues: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    for queue in queues:
        channel.queue_delete(queue)
    connection.close()


if __name__ == "__main__":
    main()
    tracer_provider.shutdown()
