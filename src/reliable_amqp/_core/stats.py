"""What a publisher has done, as counters, and the events it reports as they happen."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class EventKind(enum.Enum):
    """Things a publisher reports to an ``on_event`` hook."""

    CONNECTED = "connected"
    CONNECTION_LOST = "connection_lost"
    RECOVERED = "recovered"
    CHANNEL_LOST = "channel_lost"
    BLOCKED = "blocked"
    UNBLOCKED = "unblocked"
    #: a connection attempt failed, or an open connection was lost, and another attempt
    #: follows: ``attempt`` is its number (2 after the first failure), ``delay`` the seconds
    #: until it, ``error`` what failed (one event per failure; the WARNING log line says the same)
    RETRYING = "retrying"
    RECOVERY_FAILED = "recovery_failed"
    CLOSED = "closed"
    #: a message recovered from the spool (no caller future) failed for good: it was moved to
    #: the spool's failed table; ``error`` is the PublishError, with the message
    SPOOL_FAILED = "spool_failed"


@dataclass(frozen=True, slots=True)
class PublisherEvent:
    """One event: what happened, a human-readable detail, and when (monotonic seconds)."""

    kind: EventKind
    detail: str
    at: float
    #: for RECOVERED: seconds since the connection (or channel) was lost
    downtime: float | None = None
    #: for SPOOL_FAILED: what became of the message (a PublishError; ``.message`` is it); for
    #: RETRYING and RECOVERY_FAILED: the connection error
    error: BaseException | None = None
    #: for RETRYING: the number of the connection attempt that comes next (2 after one failure)
    attempt: int | None = None
    #: for RETRYING: seconds until that attempt
    delay: float | None = None


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Confirm latency (accept to confirm, seconds) over the most recent confirmed messages."""

    count: int
    mean: float
    p50: float
    p99: float
    max: float


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of a publisher's counters (see :meth:`Publisher.stats`)."""

    #: messages accepted by ``publish()``
    published: int
    #: resolved with a Confirmation
    confirmed: int
    #: nack frames received (a message retried after a nack counts each time)
    nacked: int
    #: failed with MessageNacked once the nack policy was spent
    failed_nacked: int
    #: failed with MessageReturned
    returned: int
    #: failed with MessageRejected
    rejected: int
    #: failed with DeliveryTimeout
    timed_out: int
    #: failed with PublisherClosed
    closed: int
    #: messages written again after their channel or connection was lost
    republished: int
    #: connections lost and recovered
    recoveries: int
    #: unresolved messages right now
    in_flight: int
    latency: LatencySummary | None


@dataclass(slots=True)
class Counters:
    """Mutable counters kept by the engine (one writer: the I/O thread or event loop)."""

    published: int = 0
    confirmed: int = 0
    nacked: int = 0
    failed_nacked: int = 0
    returned: int = 0
    rejected: int = 0
    timed_out: int = 0
    closed: int = 0
    republished: int = 0
    recoveries: int = 0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def snapshot(self, in_flight: int) -> Stats:
        """A frozen copy with the latency summary computed."""
        return Stats(
            published=self.published,
            confirmed=self.confirmed,
            nacked=self.nacked,
            failed_nacked=self.failed_nacked,
            returned=self.returned,
            rejected=self.rejected,
            timed_out=self.timed_out,
            closed=self.closed,
            republished=self.republished,
            recoveries=self.recoveries,
            in_flight=in_flight,
            latency=summarize(list(self.latencies)),
        )


def summarize(samples: list[float]) -> LatencySummary | None:
    """Mean, median, 99th percentile and max of ``samples`` (None when empty)."""
    if not samples:
        return None
    ordered = sorted(samples)
    n = len(ordered)
    # nearest rank: the ceil(0.99 n)-th sample, in integers (0.99 * n rounds both ways as a float)
    p99_rank = (99 * n + 99) // 100
    return LatencySummary(
        count=n,
        mean=sum(ordered) / n,
        p50=ordered[(n - 1) // 2],
        p99=ordered[p99_rank - 1],
        max=ordered[-1],
    )
