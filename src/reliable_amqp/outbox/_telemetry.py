"""OpenTelemetry for the outbox, through the API only (the ``otel`` extra), and nothing at all
without it: the writer's trace context stored with the row, carried into the message's
``traceparent`` so that the consumer's trace continues the request that committed the row; and
the relay's metrics (backlog, oldest age, commit-to-confirm latency, failed rows)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from reliable_amqp._otel import _is_proxy_or_noop as is_proxy_or_noop
from reliable_amqp.outbox._status import OpenWriter

try:
    from opentelemetry import context as _context
    from opentelemetry import metrics as _metrics
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - without the otel extra
    _trace = None  # type: ignore[assignment]

_NONE: tuple[str | None, str | None] = (None, None)


def current_trace() -> tuple[str | None, str | None]:
    """The writer's (traceparent, tracestate), when it is in a valid trace; else (None, None)."""
    if _trace is None:
        return _NONE
    if not _trace.get_current_span().get_span_context().is_valid:
        return _NONE
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return carrier.get("traceparent"), carrier.get("tracestate")


@contextlib.contextmanager
def continue_trace(traceparent: str | None, tracestate: str | None) -> Iterator[None]:
    """Run the publish of a row inside the writer's trace context (the publisher's own span,
    when it records one, is then the writer's child and its ``traceparent`` carries on)."""
    if _trace is None or not traceparent:
        yield
        return
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    token = _context.attach(_propagate.extract(carrier))
    try:
        yield
    finally:
        _context.detach(token)


class OutboxMetrics:
    """The relay's instruments (no-ops without a meter provider): ``reliable_amqp.outbox.*``."""

    def __init__(self, table: str, meter_provider: Any = None) -> None:
        self._latency: Any = None
        self._failed: Any = None
        self._attributes = {"reliable_amqp.outbox.table": table}
        self._open: Sequence[OpenWriter] = ()
        self._backlog: int | None = None
        self._oldest: float | None = None
        #: whether an SDK records what this reports (else nothing is measured for it)
        self.enabled = False
        if _trace is None:
            return
        provider = meter_provider if meter_provider is not None else _metrics.get_meter_provider()
        if is_proxy_or_noop(provider, _metrics):
            return  # no SDK configured (decided when the relay is made): nothing to record
        meter = provider.get_meter("reliable_amqp.outbox")
        self.enabled = True
        self._latency = meter.create_histogram(
            "reliable_amqp.outbox.commit_to_confirm",
            unit="s",
            description="From the row's write to the broker's confirm of its message",
        )
        self._failed = meter.create_counter(
            "reliable_amqp.outbox.failed",
            unit="{row}",
            description="Rows moved to the failed table",
        )
        meter.create_observable_gauge(
            "reliable_amqp.outbox.open_transaction_age",
            callbacks=[self._observe_open],
            unit="s",
            description="Age of the oldest open transaction that has written to the outbox",
        )
        meter.create_observable_gauge(
            "reliable_amqp.outbox.backlog",
            callbacks=[self._observe_backlog],
            unit="{row}",
            description="Committed rows not yet confirmed (counted up to 1,000,000)",
        )
        meter.create_observable_gauge(
            "reliable_amqp.outbox.oldest_age",
            callbacks=[self._observe_oldest],
            unit="s",
            description="Age of the oldest row a relay still has to deliver, open "
            "transactions' rows included",
        )

    def confirmed(self, latency: float) -> None:
        if self._latency is not None:
            self._latency.record(max(0.0, latency), self._attributes)

    def failed(self, count: int) -> None:
        if self._failed is not None:
            self._failed.add(count, self._attributes)

    def observe(self, backlog: int, oldest_age: float, writers: Sequence[OpenWriter]) -> None:
        """What the owner of partition 0 found at its last look (every 5 s)."""
        self._backlog = backlog
        self._oldest = oldest_age
        self._open = writers

    def _observe_backlog(self, _options: Any) -> Any:
        from opentelemetry.metrics import Observation

        if self._backlog is None:
            return []  # not this relay's to report (another owns partition 0)
        return [Observation(self._backlog, self._attributes)]

    def _observe_oldest(self, _options: Any) -> Any:
        from opentelemetry.metrics import Observation

        if self._oldest is None:
            return []
        return [Observation(self._oldest, self._attributes)]

    def _observe_open(self, _options: Any) -> Any:
        from opentelemetry.metrics import Observation

        if self._backlog is None:
            return []
        age = max((w.age_s for w in self._open), default=0.0)
        return [Observation(age, self._attributes)]
