"""Telemetry of a consumer: one CONSUMER span per message and the consume metrics.

Imported only when OpenTelemetry is in use (see :func:`consumer_telemetry`). The span continues
the publisher's trace: its parent is the context the configured propagator extracts from the
message's headers (``traceparent``, put there by the publishers), and it is the current span
while the handler runs, so the handler's own spans nest under it. Attributes follow the
messaging semantic conventions (``messaging.operation.type = process``). Metrics:
``reliable_amqp.consumer.messages`` with ``outcome`` = handled, retried, dead_lettered or
redelivered, and the handler's duration (``messaging.process.duration``, seconds).

Telemetry never raises into the consumer: a failing SDK is logged once and ignored.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._version import __version__

log = logging.getLogger("reliable_amqp")

SCOPE = "reliable_amqp"


class _HeaderGetter(Getter[dict[str, Any]]):
    """The propagator's view of a delivery's headers (text values only)."""

    def get(self, carrier: dict[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        return [value] if isinstance(value, str) else None

    def keys(self, carrier: dict[str, Any]) -> list[str]:
        return list(carrier)


_GETTER = _HeaderGetter()


class ConsumerTelemetry:
    """Spans and metrics of one consumer (None in its place: telemetry is off)."""

    def __init__(self, tracer: Any, meter: Any, queue: str) -> None:
        self._tracer = tracer
        self._queue = queue
        self._name = f"process {queue}"
        self._failed = False
        self._messages = None
        self._duration = None
        if meter is not None:
            self._messages = meter.create_counter(
                "reliable_amqp.consumer.messages",
                unit="{message}",
                description="Messages by what became of them (handled, retried, dead_lettered, "
                "redelivered)",
            )
            self._duration = meter.create_histogram(
                "messaging.process.duration", unit="s", description="Handler duration"
            )

    def begin(self, delivery: Delivery) -> tuple[Any, Any]:
        """Start the span of ``delivery`` and make it current; returns what :meth:`end` takes."""
        if self._tracer is None:
            return None, None
        try:
            parent = propagate.extract(delivery.headers, getter=_GETTER)
            attributes: dict[str, Any] = {
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": self._queue,
                "messaging.rabbitmq.destination.routing_key": delivery.routing_key,
                "messaging.message.body.size": len(delivery.body),
                "messaging.rabbitmq.message.delivery_tag": delivery.delivery_tag,
            }
            if delivery.message_id:
                attributes["messaging.message.id"] = delivery.message_id
            if delivery.attempt > 1:
                attributes["reliable_amqp.attempt"] = delivery.attempt
            span = self._tracer.start_span(
                self._name, context=parent, kind=SpanKind.CONSUMER, attributes=attributes
            )
            token = otel_context.attach(set_span_in_context(span, parent))
        except Exception:
            self._report()
            return None, None
        return span, token

    def end(
        self, started: tuple[Any, Any] | None, error: BaseException | None, seconds: float
    ) -> None:
        """End the span (with the handler's error, if any) and record the duration."""
        span, token = started if started is not None else (None, None)
        try:
            if token is not None:
                otel_context.detach(token)
            if span is not None:
                if error is not None:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
                span.end()
            if self._duration is not None:
                self._duration.record(
                    seconds,
                    {"messaging.destination.name": self._queue}
                    | ({"error.type": type(error).__qualname__} if error is not None else {}),
                )
        except Exception:
            self._report()

    def count(self, outcome: str) -> None:
        """One message more with ``outcome``."""
        if self._messages is not None:
            try:
                self._messages.add(
                    1, {"messaging.destination.name": self._queue, "outcome": outcome}
                )
            except Exception:
                self._report()

    def _report(self) -> None:
        if not self._failed:
            self._failed = True
            log.warning(
                "reliable-amqp: consumer telemetry failed; going on without it", exc_info=True
            )


def consumer_telemetry(options: PublisherOptions, queue: str) -> ConsumerTelemetry | None:
    """The consumer's telemetry, or None when nothing would be recorded (the caller checked
    ``otel_in_use`` first, so that a process without OpenTelemetry never imports it)."""
    from opentelemetry import metrics, trace

    tracer: Any = None
    provider: Any = options.tracer_provider or trace.get_tracer_provider()
    if not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        tracer = provider.get_tracer(SCOPE, __version__)
        if isinstance(tracer, trace.NoOpTracer):
            tracer = None
    meter: Any = None
    meter_provider: Any = options.meter_provider or metrics.get_meter_provider()
    if not isinstance(meter_provider, metrics.NoOpMeterProvider) and (
        type(meter_provider).__name__ != "_ProxyMeterProvider"
    ):
        meter = meter_provider.get_meter(SCOPE, __version__)
        if isinstance(meter, metrics.NoOpMeter):
            meter = None
    if tracer is None and meter is None:
        return None
    return ConsumerTelemetry(tracer, meter, queue)
