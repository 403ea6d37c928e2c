"""The global providers, each case in a fresh interpreter (they are set once per process):
nothing imported or recorded without an SDK; an SDK set before connect() is used; one set after
is not (the decision is made at connect())."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from support.broker import BrokerAdmin

pytestmark = [pytest.mark.broker]

_PRELUDE = """
import sys
from reliable_amqp import AsyncPublisher, Publisher

URL, QUEUE = sys.argv[1], sys.argv[2]

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
"""


def _run(body: str, url: str, queue: str) -> str:
    code = _PRELUDE + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", code, url, queue],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def _headers(broker: BrokerAdmin, queue: str) -> list[dict[str, object]]:
    return [dict(props.headers or {}) for props, _ in broker.drain(queue)]


def test_publishing_imports_no_opentelemetry_when_the_process_uses_none(
    broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    _run(
        """
        import asyncio
        with Publisher(URL) as publisher:
            publisher.publish("", QUEUE, b"sync").result(10)
            assert publisher._telemetry is None
        async def main():
            async with AsyncPublisher(URL) as publisher:
                await (await publisher.publish("", QUEUE, b"async"))
                assert publisher._telemetry is None
        asyncio.run(main())
        assert not loaded(), loaded()
        """,
        amqp_url,
        queue,
    )
    assert _headers(broker, queue) == [{}, {}]


def test_the_api_without_an_sdk_records_nothing(broker: BrokerAdmin, amqp_url: str) -> None:
    queue = broker.queue()
    _run(
        """
        from opentelemetry import trace
        tracer = trace.get_tracer("app")
        with Publisher(URL) as publisher, tracer.start_as_current_span("caller"):
            publisher.publish("", QUEUE, b"x").result(10)
            assert publisher._telemetry is None
        """,
        amqp_url,
        queue,
    )
    assert _headers(broker, queue) == [{}]


def test_a_global_sdk_set_before_connect_is_used_and_one_set_after_is_not(
    broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    out = _run(
        """
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        late = Publisher(URL).connect()  # decided now: no SDK yet
        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(provider)
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

        with Publisher(URL) as publisher:
            publisher.publish("", QUEUE, b"traced").result(10)
        late.publish("", QUEUE, b"late").result(10)
        late.close()
        assert [s.name for s in spans.get_finished_spans()] == ["publish amq.default"]
        data = reader.get_metrics_data()
        names = {m.name for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics}
        assert "messaging.client.sent.messages" in names, names
        print("ok")
        """,
        amqp_url,
        queue,
    )
    assert "ok" in out
    assert ["traceparent" in h for h in _headers(broker, queue)] == [True, False]
