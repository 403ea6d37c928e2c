"""Telemetry: the OpenTelemetry side of one publisher (imported only when it is used).

A publisher holds one :class:`Telemetry`, or None when there is nothing to record, and calls it
at three points: :meth:`Telemetry.on_publish` on the caller's thread (starts the PRODUCER span
as a child of the caller's current span and puts the propagator's headers on the message),
:meth:`Telemetry.on_resend` when the engine retries or republishes a message (its hook), and
:meth:`Telemetry.on_resolved` with the entries the engine resolved (ends the spans, records the
metrics). Spans wait for their resolution here, keyed by the message's issue number in the
publisher's window (``Entry.index``: unique per publisher, whatever object the engine ends up
holding), so the publishers carry nothing for them; a message whose span is not recorded has
no entry.

Telemetry never raises into the publisher: a failing SDK or propagator is logged once and the
message goes on without its span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate
from opentelemetry.trace import (
    INVALID_SPAN,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    get_current_span,
    set_span_in_context,
)

from reliable_amqp._core.entry import Entry
from reliable_amqp._core.message import (
    Confirmation,
)
from reliable_amqp._core.stats import PublisherEvent, Stats
from reliable_amqp._otel._metrics import Instruments, Member, SentKey
from reliable_amqp._otel._sampling import DropRule

log = logging.getLogger("reliable_amqp")

_PRODUCER = SpanKind.PRODUCER
_NO_SPAN = INVALID_SPAN  # what get_current_span() returns outside any span
_ERROR = StatusCode.ERROR
_CONFIRMATION = Confirmation


class Telemetry:
    """Spans and metrics for one publisher; ``None`` in its place means telemetry is off.

    :meth:`on_publish` runs on the callers' threads, the rest on the publisher's I/O thread or
    event loop (the span table is a dict: one insert, one pop per recorded message).
    """

    __slots__ = (
        "_clock",
        "_drop",
        "_failed",
        "_histogram",
        "_instruments",
        "_member",
        "_metric_attributes",
        "_names",
        "_route_attributes",
        "_sent",
        "_server",
        "_spans",
        "_tracer",
    )

    def __init__(
        self,
        *,
        tracer: Tracer | None,
        drop: DropRule | None,
        instruments: Instruments | None,
        stats: Callable[[], Stats],
        urls: tuple[str, ...],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracer = tracer
        self._drop = drop
        self._instruments = instruments
        self._histogram = instruments.histogram if instruments is not None else None
        self._clock = clock
        self._member: Member | None = None
        self._sent: dict[SentKey, int] = {}
        if instruments is not None:
            self._member = Member(stats, clock)
            self._sent = self._member.sent
            instruments.join(self._member)
        #: issue number (Entry.index) -> its recorded span, from publish to resolution
        self._spans: dict[int, Span] = {}
        self._names: dict[str, str] = {}
        self._route_attributes: dict[tuple[str, str], dict[str, Any]] = {}
        self._metric_attributes: dict[SentKey, dict[str, Any]] = {}
        self._server = _server_attributes(urls)
        self._failed = False

    @property
    def tracing(self) -> bool:
        """Whether spans may be recorded (a tracer is configured and its sampler is not off)."""
        return self._tracer is not None

    @property
    def metrics(self) -> bool:
        """Whether metrics are recorded (a meter provider is configured)."""
        return self._instruments is not None

    # --- the hot path --------------------------------------------------------------------------

    def on_publish(self, entry: Entry[Any], index: int) -> None:
        """Start the message's PRODUCER span (a child of the caller's current span) and add
        the propagator's headers (``traceparent``, ...) to the message when there is a trace
        context to carry. ``index`` is the message's issue number in the window (what the
        entry carries as ``index`` once the engine takes it)."""
        if self._tracer is None:
            return
        drop = self._drop
        if drop is not None and drop.root and get_current_span() is _NO_SPAN:
            return  # a root the sampler drops: nothing to record, nothing to carry
        try:
            span, extra = self.start(entry)
        except Exception:
            self._report_failure()
            return
        if span is not None:
            self._spans[index] = span
        if extra:
            entry.add_headers(extra)

    def start(self, entry: Entry[Any]) -> tuple[Span | None, dict[str, str]]:
        """The span of ``entry``'s message (None when not recorded) and the headers to add to
        it (none: nothing to carry)."""
        tracer = self._tracer
        if tracer is None:
            return None, {}
        drop = self._drop
        if drop is not None:
            parent = get_current_span().get_span_context()
            if drop.drops(parent):
                if parent.is_valid:  # carry the caller's (unsampled) decision downstream
                    return None, _inject(None)
                return None, {}
        exchange = entry.exchange
        name = self._names.get(exchange)
        if name is None:
            name = self._names[exchange] = f"publish {exchange or 'amq.default'}"
        attributes = dict(self._route(exchange, entry.routing_key))
        attributes["messaging.message.id"] = entry.message_id
        attributes["messaging.message.body.size"] = len(entry.body)
        span = tracer.start_span(name, kind=_PRODUCER, attributes=attributes)
        if span.is_recording():
            return span, _inject(span)
        # Not sampled: carry the decision when the caller is in a trace; a dropped root gets no
        # header (the propagator's inject would cost more than the sampler did)
        if span.get_span_context().is_valid and get_current_span().get_span_context().is_valid:
            return None, _inject(span)
        return None, {}

    def on_resend(self, entry: Entry[Any], kind: str) -> None:
        """The engine's hook: ``entry`` goes out again, ``kind`` "retry" (after a nack, with
        backoff) or "republish" (its channel or connection was lost): a span event."""
        span = self._spans.get(entry.index)
        if span is None:
            return
        if kind == "retry":
            attributes = {"reliable_amqp.nacks": entry.nacks}
        else:
            attributes = {"reliable_amqp.attempts": entry.attempts}
        try:
            span.add_event(kind, attributes)
        except Exception:
            self._report_failure()

    def on_resolved(self, entries: Iterable[Entry[Any]]) -> None:
        """Messages resolved (their ``result`` is set): end their spans, count them, record
        their durations from ``accepted`` (the clock the adapters pass the engine)."""
        spans = self._spans
        histogram = self._histogram
        if not spans and histogram is None:
            return
        try:
            self._resolved(entries, spans, histogram)
        except Exception:
            self._report_failure()

    def _resolved(
        self, entries: Iterable[Entry[Any]], spans: dict[int, Span], histogram: Any
    ) -> None:
        now = self._clock()
        sent = self._sent
        metric_attributes = self._metric_attributes
        for entry in entries:
            result = entry.outcome
            message = entry.message
            error = None if type(result) is _CONFIRMATION else type(result).__name__
            if spans:
                span = spans.pop(entry.index, None)
                if span is not None:
                    end_span(span, result, error)
            if histogram is not None:
                key = (message.exchange, error)
                sent[key] = sent.get(key, 0) + 1
                attributes = metric_attributes.get(key)
                if attributes is None:
                    assert self._instruments is not None
                    attributes = metric_attributes[key] = self._instruments.attributes(key)
                histogram.record(now - entry.accepted, attributes)

    # --- the rest ------------------------------------------------------------------------------

    def on_publisher_event(self, event: PublisherEvent) -> None:
        """A lifecycle event of the publisher (blocked time is counted from these)."""
        if self._member is not None:
            self._member.on_publisher_event(event)

    def close(self) -> None:
        """The publisher closed: its final counts stay in the metrics' sums."""
        if self._instruments is not None and self._member is not None:
            self._instruments.leave(self._member)

    def _route(self, exchange: str, routing_key: str) -> dict[str, Any]:
        key = (exchange, routing_key)
        attributes = self._route_attributes.get(key)
        if attributes is None:
            attributes = {
                "messaging.system": "rabbitmq",
                "messaging.operation.name": "publish",
                "messaging.operation.type": "send",
                "messaging.destination.name": exchange,
                **self._server,
            }
            if routing_key:
                attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
            if len(self._route_attributes) < _ROUTES_CACHED:
                self._route_attributes[key] = attributes
        return attributes

    def _report_failure(self) -> None:
        if not self._failed:  # once: a broken exporter must not flood the log per message
            self._failed = True
            log.exception("reliable-amqp: OpenTelemetry failed; publishing goes on without it")


def end_span(span: Span, result: object, error: str | None) -> None:
    """End a message's span: status ERROR and ``error.type`` when it failed."""
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(Status(_ERROR, str(result)))
    span.end()


#: at most this many (exchange, routing key) attribute sets are kept (routing keys can be many)
_ROUTES_CACHED = 1024


def _inject(span: Span | None) -> dict[str, str]:
    """The configured propagator's headers for ``span`` (None: the current context)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=set_span_in_context(span) if span is not None else None)
    return carrier


def _server_attributes(urls: tuple[str, ...]) -> dict[str, Any]:
    """``server.address`` and ``server.port`` when the publisher has one broker URL."""
    if len(urls) != 1:
        return {}  # failover: which broker a message went to is not known here
    parts = urlsplit(urls[0])
    if not parts.hostname:
        return {}
    default = 5671 if parts.scheme == "amqps" else 5672
    return {"server.address": parts.hostname, "server.port": parts.port or default}
