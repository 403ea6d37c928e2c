"""The driver's trace context, carried to the tasks: message spans continue the driver's trace.

When the driver starts a write inside a span (``with tracer.start_as_current_span("export")``),
the configured propagator's headers of that context travel with the task, and each task publishes
with them as its current context. The executors record the spans if an OpenTelemetry SDK is
configured there (the sink uses each process's global providers). Nothing is imported from
OpenTelemetry in a process that does not use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._otel import otel_in_use


def capture(options: PublisherOptions) -> dict[str, str] | None:
    """The current trace context as propagation headers (None: no context, or no OTel)."""
    if not otel_in_use(options):
        return None
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


@contextlib.contextmanager
def attached(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """Run the block with ``carrier``'s context as the current one (nothing when None)."""
    if not carrier:
        yield
        return
    try:
        from opentelemetry import context, propagate
    except ImportError:  # the executors lack the otel extra: publish untraced
        yield
        return
    token = context.attach(propagate.extract(dict(carrier)))
    try:
        yield
    finally:
        context.detach(token)
