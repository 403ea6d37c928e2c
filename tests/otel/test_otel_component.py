"""The telemetry component alone (no broker): when it exists, its spans, headers and metrics."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    StaticSampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from reliable_amqp import (
    Confirmation,
    EventKind,
    MessageNacked,
    MessageReturned,
    OutgoingMessage,
    PublisherEvent,
    PublisherOptions,
)
from reliable_amqp._core.builder import build_message
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.message import MessageProperties
from reliable_amqp._otel import telemetry_for
from reliable_amqp._otel._metrics import (
    BLOCKED_TIME,
    IN_FLIGHT,
    NACKS,
    OPERATION_DURATION,
    RECONNECTS,
    REPUBLISHED,
    RETURNED,
    SENT_MESSAGES,
)
from reliable_amqp._otel._telemetry import Telemetry
from support.broker import AMQP_DEFAULT_PORT
from support.engine import entry_for
from support.otel import Otel, make_otel, points_by, stats

URL = f"amqp://guest:guest@127.0.0.1:{AMQP_DEFAULT_PORT}/%2F"


@pytest.fixture
def otel() -> Iterator[Otel]:
    found = make_otel()
    yield found
    found.shutdown()


def _telemetry(stats_fn: Any = None, **options: Any) -> Telemetry | None:
    return telemetry_for(PublisherOptions.create(URL, **options), stats_fn or stats)


def _message(
    exchange: str = "orders", routing_key: str = "eu", body: bytes = b"twelve bytes", **props: Any
) -> Entry[None]:
    """A message as a publisher holds it while in flight (its entry)."""
    message = build_message(exchange, routing_key, body, mandatory=False, properties=props)
    return entry_for(message, None)


def _on(otel: Otel, **kwargs: Any) -> Telemetry:
    telemetry = _telemetry(**otel.options, **kwargs)
    assert telemetry is not None
    return telemetry


_issued = itertools.count(1)


def _resolve(telemetry: Telemetry, entry: Entry[None], result: Any, seconds: float) -> None:
    """Resolve one message as an adapter does: its entry with its result, accepted
    ``seconds`` ago (the span is the one :meth:`Telemetry.on_publish` kept)."""
    entry.accepted = telemetry._clock() - seconds
    entry.outcome = result
    telemetry.on_resolved([entry])


def _publish(telemetry: Telemetry, entry: Entry[None] | None = None) -> Entry[None]:
    """Publish as a publisher does: the message's issue number set, then its span started."""
    entry = entry or _message()
    entry.index = next(_issued)
    telemetry.on_publish(entry, entry.index)
    return entry


def _start(telemetry: Telemetry, entry: Entry[None]) -> tuple[Any, Entry[None]]:
    """:meth:`Telemetry.start` as ``on_publish`` uses it: the span, and the entry with the
    headers it carries added."""
    span, extra = telemetry.start(entry)
    if extra:
        entry.add_headers(extra)
    return span, entry


def _parent(sampled: bool, remote: bool) -> Any:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    span_context = SpanContext(0xABC, 0xDEF, is_remote=remote, trace_flags=flags)
    return set_span_in_context(NonRecordingSpan(span_context))


# --- when there is telemetry at all -------------------------------------------------------------


def test_no_sdk_configured_means_no_telemetry() -> None:
    # the global providers are the API's proxies in this process (no test sets them)
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert _telemetry() is None


def test_always_off_without_metrics_means_no_telemetry() -> None:
    assert _telemetry(tracer_provider=TracerProvider(sampler=ALWAYS_OFF)) is None


def test_sdk_disabled_means_no_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert _telemetry(tracer_provider=TracerProvider(), meter_provider=MeterProvider()) is None


def test_always_off_with_metrics_records_metrics_only(otel: Otel) -> None:
    telemetry = _telemetry(
        tracer_provider=TracerProvider(sampler=ALWAYS_OFF), meter_provider=otel.meter_provider
    )
    assert telemetry is not None and not telemetry.tracing and telemetry.metrics
    message = _message()
    base = message.base
    token, sent = _start(telemetry, message)
    assert token is None and sent.base is base  # no headers added


def test_tracing_without_meter_provider_records_no_metrics(otel: Otel) -> None:
    telemetry = _telemetry(tracer_provider=otel.tracer_provider)
    assert telemetry is not None and telemetry.tracing and not telemetry.metrics


def test_a_provider_must_be_one() -> None:
    with pytest.raises(Exception, match="tracer_provider must be an OpenTelemetry provider"):
        PublisherOptions.create(URL, tracer_provider=object())
    with pytest.raises(Exception, match="meter_provider cannot be given as a string"):
        PublisherOptions.from_strings(URL, {"meter_provider": "sdk"})


# --- spans --------------------------------------------------------------------------------------


def test_span_per_message_with_the_messaging_attributes(otel: Otel) -> None:
    telemetry = _on(otel)
    tracer = otel.tracer_provider.get_tracer("caller")
    with tracer.start_as_current_span("handle-order") as parent:
        message = _publish(telemetry)
    _resolve(telemetry, message, Confirmation(message.message_id, 1), 0.004)
    span = next(s for s in otel.finished() if s.name == "publish orders")
    assert span.kind is SpanKind.PRODUCER
    assert span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
    assert span.context.trace_id == parent.get_span_context().trace_id
    assert dict(span.attributes) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
        "messaging.destination.name": "orders",
        "messaging.rabbitmq.destination.routing_key": "eu",
        "messaging.message.id": message.message_id,
        "messaging.message.body.size": 12,
        "server.address": "127.0.0.1",
        "server.port": AMQP_DEFAULT_PORT,
    }
    assert span.status.status_code is StatusCode.UNSET


def test_default_exchange_is_named_amq_default_and_empty_routing_key_left_out(otel: Otel) -> None:
    telemetry = _on(otel)
    message = _publish(telemetry, _message(exchange="", routing_key=""))
    _resolve(telemetry, message, Confirmation(message.message_id, 1), 0.001)
    (span,) = otel.finished()
    assert span.name == "publish amq.default"
    assert span.attributes["messaging.destination.name"] == ""
    assert "messaging.rabbitmq.destination.routing_key" not in span.attributes


def test_no_server_attributes_with_several_urls(otel: Otel) -> None:
    options = PublisherOptions.create([URL, "amqp://h2:5673/"], **otel.options)
    telemetry = telemetry_for(options, stats)
    assert telemetry is not None
    message = _publish(telemetry)
    _resolve(telemetry, message, Confirmation(message.message_id, 1), 0.001)
    assert "server.address" not in otel.finished()[0].attributes


def test_traceparent_header_names_the_span_and_keeps_user_headers(otel: Otel) -> None:
    telemetry = _on(otel)
    original = _message(headers={"tenant": "acme", "traceparent": "stale"})
    before = (original.exchange, original.routing_key, original.body, original.mandatory)
    shared = original.base  # properties other messages may share: replaced, never changed
    message_id = original.message_id
    token, message = _start(telemetry, original)
    assert token is not None
    assert message.base is not shared and message.message_id == message_id
    assert (message.exchange, message.routing_key, message.body, message.mandatory) == before
    headers = dict(message.base.headers or {})
    assert headers["tenant"] == "acme"
    extracted = TraceContextTextMapPropagator().extract(headers)
    remote = trace.get_current_span(extracted).get_span_context()
    assert remote.span_id == token.get_span_context().span_id
    assert remote.trace_id == token.get_span_context().trace_id
    assert shared.headers == {"tenant": "acme", "traceparent": "stale"}


def test_failure_sets_error_status_and_error_type(otel: Otel) -> None:
    telemetry = _on(otel)
    message = _publish(telemetry)
    entry = message
    entry.nacks = 1
    telemetry.on_resend(entry, "retry")
    entry.attempts = 2
    telemetry.on_resend(entry, "republish")
    _resolve(telemetry, message, MessageNacked(message.message, 2), 0.3)
    (span,) = otel.finished()
    assert span.status.status_code is StatusCode.ERROR
    assert "nacked" in (span.status.description or "")
    assert span.attributes["error.type"] == "MessageNacked"
    assert [(e.name, dict(e.attributes)) for e in span.events] == [
        ("retry", {"reliable_amqp.nacks": 1}),
        ("republish", {"reliable_amqp.attempts": 2}),
    ]


def test_parent_based_off_drops_roots_without_asking_the_sdk(otel: Otel) -> None:
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    telemetry = _telemetry(tracer_provider=provider)
    assert telemetry is not None and telemetry.tracing
    message = _message()
    base = message.base
    token, sent = _start(telemetry, message)
    assert token is None and sent.base is base  # nothing to carry: no headers added


@pytest.mark.parametrize("remote", [True, False])
def test_parent_based_off_records_children_of_sampled_parents(remote: bool) -> None:
    otel = make_otel(ParentBased(ALWAYS_OFF))
    telemetry = _on(otel)
    token = otel_context.attach(_parent(sampled=True, remote=remote))
    try:
        span, message = _start(telemetry, _message())
    finally:
        otel_context.detach(token)
    assert span is not None and span.is_recording()
    assert span.get_span_context().trace_id == 0xABC
    assert "traceparent" in (message.base.headers or {})
    otel.shutdown()


def test_parent_based_off_carries_an_unsampled_parents_decision() -> None:
    telemetry = _telemetry(tracer_provider=TracerProvider(sampler=ParentBased(ALWAYS_OFF)))
    assert telemetry is not None
    token = otel_context.attach(_parent(sampled=False, remote=True))
    try:
        span, message = _start(telemetry, _message())
    finally:
        otel_context.detach(token)
    assert span is None
    traceparent = (message.base.headers or {})["traceparent"]
    assert traceparent == f"00-{0xABC:032x}-{0xDEF:016x}-00"


def test_a_sampler_that_is_asked_and_drops_a_root_adds_no_header() -> None:
    telemetry = _telemetry(tracer_provider=TracerProvider(sampler=TraceIdRatioBased(0.0)))
    assert telemetry is not None
    original = _message()
    base = original.base
    span, message = _start(telemetry, original)
    assert span is None and message.base is base


def test_a_sampler_that_is_asked_and_drops_a_child_carries_the_decision() -> None:
    telemetry = _telemetry(tracer_provider=TracerProvider(sampler=TraceIdRatioBased(0.0)))
    assert telemetry is not None
    token = otel_context.attach(_parent(sampled=False, remote=True))
    try:
        span, message = _start(telemetry, _message())
    finally:
        otel_context.detach(token)
    assert span is None
    trace_id, _, flags = (message.base.headers or {})["traceparent"].split("-")[1:]
    assert int(trace_id, 16) == 0xABC
    assert int(flags, 16) & 1 == 0  # carried, as not sampled


def test_a_custom_subclass_is_always_asked() -> None:
    class Odd(StaticSampler):
        def should_sample(self, *args: Any, **kwargs: Any) -> Any:
            return ALWAYS_ON.should_sample(*args, **kwargs)

    from opentelemetry.sdk.trace.sampling import Decision

    telemetry = _telemetry(tracer_provider=TracerProvider(sampler=Odd(Decision.DROP)))
    assert telemetry is not None
    span, _ = _start(telemetry, _message())
    assert span is not None and span.is_recording()


def test_headers_are_built_for_properties_objects(otel: Otel) -> None:
    telemetry = _on(otel)
    made = OutgoingMessage("x", "y", b"z", MessageProperties(message_id="m-1", priority=3))
    _, sent = _start(telemetry, entry_for(made, None, size=1))
    assert sent.message.properties.priority == 3 and sent.message_id == "m-1"
    assert set(sent.message.properties.headers or {}) == {"traceparent"}


# --- metrics ------------------------------------------------------------------------------------


def test_sent_messages_and_duration_count_every_resolution(otel: Otel) -> None:
    telemetry = _on(otel)
    for i in range(7):
        message = _publish(telemetry)
        if i < 4:
            result: Any = Confirmation(message.message_id, 1)
        elif i < 6:
            result = MessageNacked(message.message, 5)
        else:
            result = MessageReturned(message.message, 1, 312, "NO_ROUTE")
        _resolve(telemetry, message, result, 0.01 * (i + 1))
    metrics = otel.metrics()
    sent = points_by(metrics[SENT_MESSAGES], "error.type")
    assert {k: p.value for k, p in sent.items()} == {
        None: 4,
        "MessageNacked": 2,
        "MessageReturned": 1,
    }
    assert dict(sent[None].attributes) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.name": "publish",
        "messaging.operation.type": "send",
        "messaging.destination.name": "orders",
    }
    durations = points_by(metrics[OPERATION_DURATION], "error.type")
    assert sum(p.count for p in durations.values()) == 7
    assert durations[None].count == 4
    assert durations[None].sum == pytest.approx(0.01 + 0.02 + 0.03 + 0.04, abs=1e-3)
    assert list(durations[None].explicit_bounds)[:3] == [0.005, 0.01, 0.025]


def test_library_counters_read_stats_and_survive_close(otel: Otel) -> None:
    current = {"value": stats(in_flight=3, recoveries=2, republished=5, nacked=4, returned=1)}
    telemetry = _on(otel, stats_fn=lambda: current["value"])
    values = {name: otel.metrics()[name][0].value for name in _LIBRARY}
    assert values == {IN_FLIGHT: 3, RECONNECTS: 2, REPUBLISHED: 5, NACKS: 4, RETURNED: 1}
    current["value"] = stats(in_flight=0, recoveries=3, republished=6, nacked=4, returned=2)
    telemetry.close()
    values = {name: otel.metrics()[name][0].value for name in _LIBRARY}
    assert values == {IN_FLIGHT: 0, RECONNECTS: 3, REPUBLISHED: 6, NACKS: 4, RETURNED: 2}


_LIBRARY = (IN_FLIGHT, RECONNECTS, REPUBLISHED, NACKS, RETURNED)


def test_two_publishers_on_one_meter_provider_are_summed(otel: Otel) -> None:
    first = _on(otel, stats_fn=lambda: stats(in_flight=2, republished=1))
    second = _on(otel, stats_fn=lambda: stats(in_flight=5, republished=10))
    for telemetry in (first, second):
        message = _publish(telemetry)
        _resolve(telemetry, message, Confirmation(message.message_id, 1), 0.01)
    metrics = otel.metrics()
    assert metrics[IN_FLIGHT][0].value == 7
    assert metrics[REPUBLISHED][0].value == 11
    assert metrics[SENT_MESSAGES][0].value == 2
    assert sum(p.count for p in metrics[OPERATION_DURATION]) == 2
    first.close()
    second.close()
    metrics = otel.metrics()
    assert metrics[SENT_MESSAGES][0].value == 2  # closed publishers' counts stay
    assert metrics[REPUBLISHED][0].value == 11


class _Source:
    """Stands for a publisher: its bound stats() is held weakly."""

    def __init__(self) -> None:
        self.value = stats(republished=4, in_flight=1)

    def stats(self) -> Any:
        return self.value


def test_a_publisher_dropped_without_close_keeps_its_last_counts(otel: Otel) -> None:
    source = _Source()
    telemetry = _on(otel, stats_fn=source.stats)
    assert otel.metrics()[REPUBLISHED][0].value == 4
    del source
    gc.collect()
    metrics = otel.metrics()
    assert metrics[REPUBLISHED][0].value == 4
    assert metrics[IN_FLIGHT][0].value == 0
    del telemetry


def test_blocked_time_counts_from_blocked_to_unblocked(otel: Otel) -> None:
    now = {"t": 100.0}
    telemetry = _on(otel)
    assert telemetry._member is not None
    telemetry._member._clock = lambda: now["t"]
    telemetry.on_publisher_event(PublisherEvent(EventKind.BLOCKED, "memory", 100.0))
    now["t"] = 102.5
    assert otel.metrics()[BLOCKED_TIME][0].value == pytest.approx(2.5)  # still blocked
    telemetry.on_publisher_event(PublisherEvent(EventKind.UNBLOCKED, "", 103.0))
    telemetry.on_publisher_event(PublisherEvent(EventKind.BLOCKED, "disk", 110.0))
    telemetry.on_publisher_event(PublisherEvent(EventKind.CONNECTION_LOST, "", 111.0))
    now["t"] = 200.0
    assert otel.metrics()[BLOCKED_TIME][0].value == pytest.approx(4.0)


def test_spans_wait_in_the_table_until_resolved_and_leave_it(otel: Otel) -> None:
    telemetry = _on(otel)
    messages = [_publish(telemetry) for _ in range(3)]
    assert len(telemetry._spans) == 3 and not otel.finished()
    _resolve(telemetry, messages[1], Confirmation(messages[1].message_id, 1), 0.01)
    assert len(telemetry._spans) == 2 and len(otel.finished()) == 1
    assert otel.finished()[0].attributes["messaging.message.id"] == messages[1].message_id


def test_a_failing_sdk_never_breaks_publishing(
    otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    telemetry = _on(otel)

    class Broken:
        def start_span(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("exporter down")

    telemetry._tracer = Broken()  # type: ignore[assignment]
    message = _message()
    base = message.base
    telemetry.on_publish(message, 1)
    telemetry.on_publish(message, 2)
    assert message.base is base  # published as it was
    assert sum("OpenTelemetry failed" in r.getMessage() for r in caplog.records) == 1


def test_properties_with_trace_headers_equal_what_replace_builds() -> None:
    import dataclasses

    from reliable_amqp._core.message import with_headers

    base = MessageProperties(
        content_type="a/b", headers={"x": 1}, priority=4, expiration="60000", app_id="app"
    )
    built = with_headers(base, {"x": 1, "traceparent": "00-1-2-01"})
    assert built == dataclasses.replace(base, headers={"x": 1, "traceparent": "00-1-2-01"})
    assert base.headers == {"x": 1}
