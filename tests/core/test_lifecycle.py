"""Unit tests of ``_core/lifecycle.py``: the events both publishers report, and outage downtime."""

from __future__ import annotations

import logging

import pytest

from reliable_amqp._core.lifecycle import Lifecycle
from reliable_amqp._core.stats import Counters, EventKind, PublisherEvent


class _Clock:
    """A monotonic clock the test moves by hand (dyadic steps, so downtimes are exact)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lifecycle() -> tuple[Lifecycle, list[PublisherEvent], Counters, _Clock]:
    events: list[PublisherEvent] = []
    counters, clock = Counters(), _Clock()
    return Lifecycle(events.append, counters, clock), events, counters, clock


def test_the_first_open_reports_connected() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    clock.now = 1.5
    lifecycle.opened()
    assert events == [PublisherEvent(EventKind.CONNECTED, "connected; confirm mode on", 1.5)]
    assert events[0].downtime is None and counters.recoveries == 0


def test_a_recovered_connection_reports_its_downtime_and_counts_a_recovery() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    lifecycle.opened()
    clock.now = 10.0
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "socket reset")
    clock.now = 12.5
    lifecycle.opened()
    assert events[1:] == [
        PublisherEvent(EventKind.CONNECTION_LOST, "socket reset", 10.0),
        PublisherEvent(EventKind.RECOVERED, "connection recovered after 2.500 s", 12.5, 2.5),
    ]
    assert counters.recoveries == 1


def test_a_recovered_channel_is_reported_but_not_counted_as_a_recovery() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    lifecycle.opened()
    clock.now = 4.0
    lifecycle.lost("channel", EventKind.CHANNEL_LOST, "404 NOT_FOUND")
    clock.now = 4.25
    lifecycle.opened()
    assert events[-1] == PublisherEvent(
        EventKind.RECOVERED, "channel recovered after 0.250 s", 4.25, 0.25
    )
    assert counters.recoveries == 0


def test_a_lost_connection_takes_over_a_lost_channel_keeping_its_start() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    lifecycle.opened()
    clock.now = 1.0
    lifecycle.lost("channel", EventKind.CHANNEL_LOST, "channel closed")
    clock.now = 3.0
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "connection closed")
    clock.now = 6.0
    lifecycle.opened()
    assert [e.kind for e in events] == [
        EventKind.CONNECTED,
        EventKind.CHANNEL_LOST,
        EventKind.CONNECTION_LOST,
        EventKind.RECOVERED,
    ]
    assert events[-1].detail == "connection recovered after 5.000 s"
    assert events[-1].downtime == 5.0 and counters.recoveries == 1


def test_a_lost_channel_does_not_take_over_a_lost_connection() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    lifecycle.opened()
    clock.now = 1.0
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "reset")
    clock.now = 2.0
    lifecycle.lost("channel", EventKind.CHANNEL_LOST, "closed too")
    clock.now = 2.0
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "reset again")
    clock.now = 9.0
    lifecycle.opened()
    assert events[-1] == PublisherEvent(
        EventKind.RECOVERED, "connection recovered after 8.000 s", 9.0, 8.0
    )
    assert counters.recoveries == 1


def test_each_outage_is_measured_from_its_own_start() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    lifecycle.opened()
    for start, end in [(1.0, 2.0), (10.0, 10.5)]:
        clock.now = start
        lifecycle.lost("connection", EventKind.CONNECTION_LOST, "lost")
        clock.now = end
        lifecycle.opened()
    assert [e.downtime for e in events if e.kind is EventKind.RECOVERED] == [1.0, 0.5]
    assert counters.recoveries == 2


def test_opened_again_without_a_loss_reports_nothing() -> None:
    lifecycle, events, counters, _ = _lifecycle()
    lifecycle.opened()
    lifecycle.opened()
    assert [e.kind for e in events] == [EventKind.CONNECTED]
    assert counters.recoveries == 0


def test_a_loss_before_the_first_open_ends_in_connected_not_recovered() -> None:
    lifecycle, events, counters, clock = _lifecycle()
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "refused")
    clock.now = 3.0
    lifecycle.opened()
    clock.now = 5.0
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "reset")
    clock.now = 5.5
    lifecycle.opened()
    assert [e.kind for e in events] == [
        EventKind.CONNECTION_LOST,
        EventKind.CONNECTED,
        EventKind.CONNECTION_LOST,
        EventKind.RECOVERED,
    ]
    # the outage before the first open is forgotten: the recovery measures the later one
    assert events[-1].downtime == 0.5 and counters.recoveries == 1


def test_without_a_hook_recoveries_are_still_counted() -> None:
    counters, clock = Counters(), _Clock()
    lifecycle = Lifecycle(None, counters, clock)
    lifecycle.emit(EventKind.BLOCKED, "nobody listens")
    lifecycle.opened()
    lifecycle.lost("connection", EventKind.CONNECTION_LOST, "reset")
    lifecycle.opened()
    assert counters.recoveries == 1


def test_emit_passes_kind_detail_time_and_downtime() -> None:
    lifecycle, events, _, clock = _lifecycle()
    clock.now = 7.0
    lifecycle.emit(EventKind.BLOCKED, "memory alarm")
    lifecycle.emit(EventKind.UNBLOCKED, "alarm cleared", downtime=0.75)
    assert events == [
        PublisherEvent(EventKind.BLOCKED, "memory alarm", 7.0, None),
        PublisherEvent(EventKind.UNBLOCKED, "alarm cleared", 7.0, 0.75),
    ]


def test_a_hook_that_raises_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[PublisherEvent] = []

    def hook(event: PublisherEvent) -> None:
        calls.append(event)
        raise RuntimeError("hook bug")

    counters = Counters()
    lifecycle = Lifecycle(hook, counters, lambda: 0.0)
    with caplog.at_level(logging.ERROR, logger="reliable_amqp"):
        lifecycle.opened()
        lifecycle.lost("connection", EventKind.CONNECTION_LOST, "reset")
        lifecycle.opened()
    assert [e.kind for e in calls] == [
        EventKind.CONNECTED,
        EventKind.CONNECTION_LOST,
        EventKind.RECOVERED,
    ]
    assert counters.recoveries == 1  # the bookkeeping went on despite the hook
    records = [r for r in caplog.records if r.name == "reliable_amqp"]
    assert len(records) == 3
    assert all("on_event hook raised" in r.getMessage() for r in records)
    assert all(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in records)
