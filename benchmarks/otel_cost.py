"""What OpenTelemetry costs the publisher: client CPU per confirmed message, per configuration.

    bash scripts/dev.sh run python benchmarks/otel_cost.py                  # 100,000 x 12 B, 3 runs
    bash scripts/dev.sh run python benchmarks/otel_cost.py --count 20000 --repeat 5
    bash scripts/dev.sh run python benchmarks/otel_cost.py --publisher async
    bash scripts/dev.sh run python benchmarks/otel_cost.py --micro          # per-call costs

Each case runs in a fresh interpreter (OpenTelemetry's global providers are set once per
process), publishes ``--count`` persistent messages with ``Publisher.publish()`` (or
``AsyncPublisher.publish()``) to a fresh durable queue on the local broker ($AMQP_URL), waits for
every confirm, and reports the process CPU time (``time.process_time()``: every thread, the I/O
thread included) per message after a warm-up. The cases are interleaved, each reports the median
of ``--repeat`` runs, and ratios are of medians against the first case:

- ``not installed``: ``import opentelemetry`` fails (an import hook refuses it);
- ``API, no SDK``: the API is imported and used by the application, no SDK is configured;
- ``SDK, ALWAYS_OFF``: a global SDK TracerProvider whose sampler is ``ALWAYS_OFF``, no meter
  provider;
- ``SDK, ParentBased(ALWAYS_OFF)``: the sampler decides per message (no parent here: dropped);
- ``SDK, ALWAYS_OFF + metrics``: as ``ALWAYS_OFF``, plus an SDK MeterProvider (the duration
  histogram records every message);
- ``SDK recording, traces only``: every span recorded (ALWAYS_ON, a BatchSpanProcessor with an
  exporter that drops what it is given), the traceparent header on every message, no metrics;
- ``SDK recording``: the same, and the metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
WARMUP = 5_000

CASES = {
    "not installed": "none",
    "API, no SDK": "api",
    "SDK, ALWAYS_OFF": "always_off",
    "SDK, ParentBased(ALWAYS_OFF)": "parent_off",
    "SDK, ALWAYS_OFF + metrics": "always_off_metrics",
    "SDK recording, traces only": "recording_traces",
    "SDK recording": "recording",
}


class _RefuseOpenTelemetry:
    """A meta path finder for which ``opentelemetry`` is not installed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r} (refused by otel_cost)")


def configure(case: str) -> None:
    """Set this process up as ``case`` says (before any publisher connects)."""
    if case == "none":
        sys.meta_path.insert(0, _RefuseOpenTelemetry())
        return
    from opentelemetry import metrics, trace

    tracer = trace.get_tracer("app")  # the application uses the API
    assert tracer is not None
    if case == "api":
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    samplers = {
        "always_off": ALWAYS_OFF,
        "parent_off": ParentBased(ALWAYS_OFF),
        "always_off_metrics": ALWAYS_OFF,
        "recording_traces": ALWAYS_ON,
        "recording": ALWAYS_ON,
    }
    provider = TracerProvider(sampler=samplers[case])
    if case in ("recording_traces", "recording"):
        provider.add_span_processor(BatchSpanProcessor(Discard()))
    trace.set_tracer_provider(provider)
    if case in ("always_off_metrics", "recording"):
        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))


def _queue(url: str, delete: str | None = None) -> str:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    if delete is not None:
        connection.channel().queue_delete(delete)
        connection.close()
        return delete
    queue = f"ra-otel-cost-{uuid.uuid4().hex[:10]}"
    connection.channel().queue_declare(queue, durable=True)
    connection.close()
    return queue


def one_run(url: str, case: str, count: int, size: int, publisher_kind: str) -> dict[str, Any]:
    """In this (fresh) process: configure ``case``, publish, return CPU seconds and checks."""
    configure(case)
    from reliable_amqp import AsyncPublisher, Publisher

    body = b"x" * size
    queue = _queue(url)
    try:
        if publisher_kind == "sync":
            with Publisher(url) as publisher:
                publish = publisher.publish
                for _ in range(WARMUP):
                    publish("", queue, body)
                assert publisher.flush() == 0
                started = time.process_time()
                for _ in range(count):
                    publish("", queue, body)
                assert publisher.flush() == 0
                spent = time.process_time() - started
                telemetry = publisher._telemetry
                confirmed = publisher.stats().confirmed
        else:

            async def run() -> tuple[float, Any, int]:
                async with AsyncPublisher(url) as publisher:
                    publish = publisher.publish
                    for _ in range(WARMUP):
                        await publish("", queue, body)
                    assert await publisher.flush() == 0
                    started = time.process_time()
                    for _ in range(count):
                        await publish("", queue, body)
                    assert await publisher.flush() == 0
                    return (
                        time.process_time() - started,
                        publisher._telemetry,
                        publisher.stats().confirmed,
                    )

            spent, telemetry, confirmed = asyncio.run(run())
    finally:
        _queue(url, delete=queue)
    assert confirmed == count + WARMUP
    loaded = any(m.split(".")[0] == "opentelemetry" for m in sys.modules)
    return {
        "cpu_s": spent,
        "telemetry": None if telemetry is None else type(telemetry).__name__,
        "tracing": bool(telemetry is not None and telemetry.tracing),
        "metrics": bool(telemetry is not None and telemetry.metrics),
        "otel_loaded": loaded,
    }


def micro(calls: int = 500_000) -> None:
    """The per-message work the publishers add, timed in-process (no broker, no noise from it):
    the test with no telemetry, ``on_publish`` for a root ``ParentBased(ALWAYS_OFF)`` drops,
    ``on_resolved`` with nothing to record."""
    import timeit

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from reliable_amqp import PublisherOptions
    from reliable_amqp._core.builder import build_message
    from reliable_amqp._core.entry import Entry, new_entry
    from reliable_amqp._otel import telemetry_for

    options = PublisherOptions.create(
        URL, tracer_provider=TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    )
    telemetry = telemetry_for(options, lambda: None)  # type: ignore[arg-type,return-value]
    assert telemetry is not None and telemetry.tracing
    message = build_message("", "q", b"x" * 12, mandatory=False, properties={})
    parts = (message.exchange, message.routing_key, message.body, message.base, False)
    entries: list[Entry[None]] = [new_entry(*parts, message.message_id) for _ in range(100)]
    none = None
    rows = {
        "no telemetry: `if telemetry is not None`": timeit.timeit(
            "telemetry is not None", globals={"telemetry": none}, number=calls
        ),
        "ParentBased(ALWAYS_OFF), no parent: on_publish()": timeit.timeit(
            lambda: telemetry.on_publish(entries[0], 1), number=calls
        ),
        "nothing to record: on_resolved(), per message": timeit.timeit(
            lambda: telemetry.on_resolved(entries), number=calls // 100
        ),
    }
    print(f"== per-message work, {calls:,} calls ==")
    for name, seconds in rows.items():
        print(f"{name:<52} {seconds / calls * 1e6:6.3f} us")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--publisher", choices=("sync", "async"), default="sync")
    parser.add_argument("--url", default=URL)
    parser.add_argument("--only", help="comma-separated case keys (" + ", ".join(CASES.values()))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--micro", action="store_true", help="time the per-message calls only")
    parser.add_argument("--one-run", metavar="CASE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro:
        micro()
        return 0
    if args.one_run:
        result = one_run(args.url, args.one_run, args.count, args.size, args.publisher)
        print(json.dumps(result))
        return 0
    keys = set(args.only.split(",")) if args.only else set(CASES.values())
    cases = {name: key for name, key in CASES.items() if key in keys}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    seen: dict[str, dict[str, Any]] = {}
    for n in range(args.repeat):
        print(f" pass {n + 1} of {args.repeat}", file=sys.stderr)
        for name, key in cases.items():
            command = [
                *(sys.executable, __file__, "--one-run", key, "--url", args.url),
                *("--count", str(args.count), "--size", str(args.size)),
                *("--publisher", args.publisher),
            ]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            result = json.loads(done.stdout.strip().splitlines()[-1])
            seen[name] = result
            cpu[name].append(result["cpu_s"] / args.count * 1e6)
            print(f"  {name:<32} {cpu[name][-1]:7.2f} us/msg", file=sys.stderr)
    base = statistics.median(next(iter(cpu.values())))
    rows = []
    for name in cases:
        median = statistics.median(cpu[name])
        rows.append(
            {
                "case": name,
                "us_per_msg": round(median, 3),
                "min": round(min(cpu[name]), 3),
                "max": round(max(cpu[name]), 3),
                "ratio": round(median / base, 3),
                "telemetry": seen[name]["telemetry"],
                "tracing": seen[name]["tracing"],
                "metrics": seen[name]["metrics"],
                "otel_loaded": seen[name]["otel_loaded"],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"\n== client CPU per confirmed message with OpenTelemetry: {args.count:,} persistent x "
        f"{args.size} B, {args.publisher} publish(), median of {args.repeat} =="
    )
    print(f"{'case':<32} {'us/msg':>7} {'(min-max)':>13} {'ratio':>6}  telemetry")
    for row in rows:
        what = "off (None)"
        if row["telemetry"] is not None:
            what = ", ".join(k for k in ("tracing", "metrics") if row[k]) or "on"
        spread = f"{row['min']:.2f}-{row['max']:.2f}"
        print(
            f"{row['case']:<32} {row['us_per_msg']:7.2f} {spread:>13} {row['ratio']:6.3f}  {what}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
