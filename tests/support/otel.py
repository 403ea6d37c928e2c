"""Helpers for the OpenTelemetry tests: SDK providers with in-memory exporters, metric reading."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler

from reliable_amqp import Stats


@dataclass
class Otel:
    """A tracer provider and a meter provider whose output the test reads back."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    options: dict[str, Any] = field(default_factory=dict)

    def finished(self) -> list[Any]:
        """The spans ended so far."""
        return list(self.spans.get_finished_spans())

    def metrics(self) -> dict[str, list[Any]]:
        """Metric name -> its data points, collected now."""
        found: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        if data is None:
            return found
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found

    def shutdown(self) -> None:
        """Stop both providers (their readers and processors)."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def make_otel(sampler: Sampler | None = None) -> Otel:
    """Fresh providers (never the global ones): pass ``otel.options`` to a publisher."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler) if sampler else TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    otel = Otel(spans, reader, tracer_provider, meter_provider)
    otel.options = {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
    return otel


def points_by(points: list[Any], attribute: str) -> dict[Any, Any]:
    """Data points keyed by one attribute's value (None when a point lacks it)."""
    return {dict(p.attributes).get(attribute): p for p in points}


def stats(**values: int) -> Stats:
    """A Stats snapshot with the given counters (the rest 0)."""
    names = (
        "published",
        "confirmed",
        "nacked",
        "failed_nacked",
        "returned",
        "rejected",
        "timed_out",
        "closed",
        "republished",
        "recoveries",
        "in_flight",
    )
    unknown = set(values) - set(names)
    assert not unknown, unknown
    return Stats(**{n: values.get(n, 0) for n in names}, latency=None)
