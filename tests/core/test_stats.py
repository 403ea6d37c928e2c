"""Unit tests of ``_core/stats.py``: counters, their snapshot and the latency summary."""

from __future__ import annotations

import dataclasses

import pytest

from reliable_amqp._core.stats import (
    Counters,
    EventKind,
    LatencySummary,
    PublisherEvent,
    Stats,
    summarize,
)


def test_summarize_nothing_is_none() -> None:
    assert summarize([]) is None


def test_summarize_one_sample() -> None:
    assert summarize([0.5]) == LatencySummary(count=1, mean=0.5, p50=0.5, p99=0.5, max=0.5)


def test_summarize_sorts_and_takes_the_lower_median() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert summarize(samples) == LatencySummary(count=4, mean=2.5, p50=2.0, p99=4.0, max=4.0)
    assert samples == [4.0, 1.0, 3.0, 2.0]  # the caller's list is not sorted in place


def test_summarize_ten_samples() -> None:
    summary = summarize([float(n) for n in range(10, 0, -1)])
    assert summary == LatencySummary(count=10, mean=5.5, p50=5.0, p99=10.0, max=10.0)


def test_summarize_p99_of_many_samples_ignores_the_slowest_one_percent() -> None:
    samples = [1.0] * 989 + [50.0] * 11  # 1.1 % slow ones
    summary = summarize(samples)
    assert summary is not None and (summary.p50, summary.p99, summary.max) == (1.0, 50.0, 50.0)
    samples = [1.0] * 995 + [50.0] * 5  # 0.5 % slow ones
    summary = summarize(samples)
    assert summary is not None and (summary.p99, summary.max) == (1.0, 50.0)


@pytest.mark.parametrize(
    "n, rank",
    [(1, 1), (2, 2), (99, 99), (100, 99), (101, 100), (200, 198), (1000, 990), (10_000, 9900)],
)
def test_summarize_p99_is_the_nearest_rank(n: int, rank: int) -> None:
    # nearest rank: the ceil(0.99 n)-th smallest sample (p99 of 100 samples is the 99th)
    summary = summarize([float(k) for k in range(n, 0, -1)])
    assert summary is not None and summary.p99 == float(rank)


def test_snapshot_copies_every_counter() -> None:
    counters = Counters()
    names = "published confirmed nacked failed_nacked returned rejected timed_out closed"
    for i, name in enumerate([*names.split(), "republished", "recoveries"], start=1):
        setattr(counters, name, i)
    counters.latencies.extend([0.25, 0.75])
    assert counters.snapshot(in_flight=42) == Stats(
        published=1,
        confirmed=2,
        nacked=3,
        failed_nacked=4,
        returned=5,
        rejected=6,
        timed_out=7,
        closed=8,
        republished=9,
        recoveries=10,
        in_flight=42,
        latency=LatencySummary(count=2, mean=0.5, p50=0.25, p99=0.75, max=0.75),
    )


def test_a_fresh_snapshot_is_all_zero_without_latency() -> None:
    stats = Counters().snapshot(0)
    assert stats.latency is None
    assert all(
        getattr(stats, f.name) == 0 for f in dataclasses.fields(Stats) if f.name != "latency"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.published = 1  # type: ignore[misc]


def test_latencies_keep_the_latest_ten_thousand() -> None:
    counters = Counters()
    counters.latencies.extend(float(n) for n in range(10_005))
    summary = counters.snapshot(0).latency
    assert summary is not None and summary.count == 10_000
    assert min(counters.latencies) == 5.0 and summary.max == 10_004.0
    assert Counters().latencies is not counters.latencies  # one deque per Counters


def test_events_default_to_no_downtime_and_are_frozen() -> None:
    event = PublisherEvent(EventKind.CLOSED, "closed", 3.0)
    assert event.downtime is None and event.attempt is None and event.delay is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.at = 4.0  # type: ignore[misc]
    assert [k.value for k in EventKind] == [
        "connected",
        "connection_lost",
        "recovered",
        "channel_lost",
        "blocked",
        "unblocked",
        "retrying",
        "recovery_failed",
        "closed",
        "spool_failed",
    ]
