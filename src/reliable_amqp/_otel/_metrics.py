"""The instruments, one set per meter, shared by every publisher that reports to it.

A meter keeps the first instrument of a name and ignores a second one's callbacks, so the
publishers of a process cannot each create their own: one :class:`Instruments` per meter provider
holds the histogram and the observable instruments, and sums what its publishers report.

Counters cost nothing per message: ``messaging.client.sent.messages`` is observed from counts a
publisher keeps in a dict (one writer, its I/O thread or event loop), and the library's own
counters from its ``stats()``. Only the duration histogram is recorded per message (there is no
observable histogram). A publisher that closes hands its final counts to the instruments, so the
sums never go down.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Histogram, Meter, MeterProvider, Observation

from reliable_amqp._core.stats import EventKind, PublisherEvent, Stats

SENT_MESSAGES = "messaging.client.sent.messages"
OPERATION_DURATION = "messaging.client.operation.duration"
IN_FLIGHT = "reliable_amqp.messages.in_flight"
RECONNECTS = "reliable_amqp.reconnects"
REPUBLISHED = "reliable_amqp.messages.republished"
NACKS = "reliable_amqp.nacks"
RETURNED = "reliable_amqp.messages.returned"
BLOCKED_TIME = "reliable_amqp.blocked.time"

#: the bucket boundaries the messaging conventions advise for operation durations (seconds)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)

#: the attributes of the library's own counters
LIBRARY_ATTRIBUTES = {"messaging.system": "rabbitmq"}

#: (exchange, error.type or None): how :class:`Member` counts sent messages
SentKey = tuple[str, str | None]

#: the Stats counters behind the library's own observable counters
_STATS_COUNTERS = {
    RECONNECTS: "recoveries",
    REPUBLISHED: "republished",
    NACKS: "nacked",
    RETURNED: "returned",
}


class Member:
    """What one publisher reports: its sent counts, its stats and how long it was blocked."""

    def __init__(self, stats: Callable[[], Stats], clock: Callable[[], float]) -> None:
        # the publisher's stats(), held weakly: a publisher dropped without close() is retired
        # with the last counts seen
        self._stats: Callable[[], Callable[[], Stats] | None]
        if hasattr(stats, "__self__") and hasattr(stats, "__func__"):
            self._stats = weakref.WeakMethod(stats)
        else:
            self._stats = lambda: stats
        self._clock = clock
        #: sent messages by (exchange, error.type): written by the publisher's I/O side only
        self.sent: dict[SentKey, int] = {}
        self.last: Stats | None = None
        self.blocked_total = 0.0
        self.blocked_since: float | None = None

    def snapshot(self) -> Stats | None:
        """The publisher's stats now (None once it is gone)."""
        stats = self._stats()
        if stats is None:
            return None
        self.last = stats()
        return self.last

    def blocked_time(self) -> float:
        """Seconds blocked so far, the current block included."""
        since = self.blocked_since
        total = self.blocked_total
        return total if since is None else total + max(0.0, self._clock() - since)

    def on_publisher_event(self, event: PublisherEvent) -> None:
        """Count blocked time from BLOCKED to UNBLOCKED (or to the connection's end)."""
        if event.kind is EventKind.BLOCKED:
            if self.blocked_since is None:
                self.blocked_since = event.at
        elif self.blocked_since is not None and event.kind in _UNBLOCKING:
            self.blocked_total += max(0.0, event.at - self.blocked_since)
            self.blocked_since = None


#: events after which a connection is no longer blocked (a new connection starts unblocked)
_UNBLOCKING = frozenset(
    {EventKind.UNBLOCKED, EventKind.CONNECTION_LOST, EventKind.RECOVERY_FAILED, EventKind.CLOSED}
)


class Instruments:
    """The instruments of one meter provider, and the publishers reporting to them."""

    def __init__(self, meter: Meter) -> None:
        self._lock = threading.Lock()
        self._members: list[Member] = []
        # what closed publishers reported last: added to the live ones, so no sum goes down
        self._retired_sent: dict[SentKey, int] = {}
        self._retired: dict[str, float] = dict.fromkeys((*_STATS_COUNTERS, BLOCKED_TIME), 0)
        self._attributes: dict[SentKey, dict[str, Any]] = {}
        self.histogram = _histogram(meter)
        meter.create_observable_counter(
            SENT_MESSAGES,
            callbacks=[self._observe_sent],
            unit="{message}",
            description="Messages the publisher sent and saw resolved (error.type on failures).",
        )
        meter.create_observable_up_down_counter(
            IN_FLIGHT,
            callbacks=[self._observe_in_flight],
            unit="{message}",
            description="Messages published and not resolved yet.",
        )
        descriptions = {
            RECONNECTS: ("{reconnect}", "Connections lost and recovered."),
            REPUBLISHED: (
                "{message}",
                "Messages written again after a connection or channel loss.",
            ),
            NACKS: ("{nack}", "basic.nack frames received (a retried message counts each time)."),
            RETURNED: ("{message}", "Messages returned as unroutable (mandatory)."),
        }
        for name, (unit, description) in descriptions.items():
            meter.create_observable_counter(
                name, callbacks=[self._stats_counter(name)], unit=unit, description=description
            )
        meter.create_observable_counter(
            BLOCKED_TIME,
            callbacks=[self._observe_blocked],
            unit="s",
            description="Time the broker kept the connection blocked (connection.blocked).",
        )

    # --- membership ---------------------------------------------------------------------------

    def join(self, member: Member) -> None:
        """Start reporting a publisher's counts."""
        with self._lock:
            self._members.append(member)

    def leave(self, member: Member) -> None:
        """Stop reporting a publisher; its final counts stay in the sums."""
        with self._lock:
            if member in self._members:
                member.snapshot()
                self._retire(member)

    def _retire(self, member: Member) -> None:  # under the lock
        self._members.remove(member)
        for key, count in dict(member.sent).items():
            self._retired_sent[key] = self._retired_sent.get(key, 0) + count
        last = member.last
        if last is not None:
            for name, field in _STATS_COUNTERS.items():
                self._retired[name] += getattr(last, field)
        self._retired[BLOCKED_TIME] += member.blocked_time()

    def attributes(self, key: SentKey) -> dict[str, Any]:
        """The metric attributes of messages sent to ``key[0]`` that ended as ``key[1]``."""
        attributes = self._attributes.get(key)
        if attributes is None:
            exchange, error = key
            attributes = {
                "messaging.system": "rabbitmq",
                "messaging.operation.name": "publish",
                "messaging.operation.type": "send",
                "messaging.destination.name": exchange,
            }
            if error is not None:
                attributes["error.type"] = error
            self._attributes[key] = attributes
        return attributes

    # --- observation (the metric reader's thread) ---------------------------------------------

    def _stats(self) -> list[Stats]:  # under the lock
        found = []
        for member in list(self._members):
            stats = member.snapshot()
            if stats is None:  # the publisher was dropped without close()
                self._retire(member)
            else:
                found.append(stats)
        return found

    def _observe_sent(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            totals = dict(self._retired_sent)
            for member in self._members:
                for key, count in dict(member.sent).items():
                    totals[key] = totals.get(key, 0) + count
        return [Observation(count, self.attributes(key)) for key, count in totals.items()]

    def _observe_in_flight(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            value = sum(s.in_flight for s in self._stats())
        return [Observation(value, LIBRARY_ATTRIBUTES)]

    def _stats_counter(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        field = _STATS_COUNTERS[name]

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self._lock:
                value = self._retired[name] + sum(getattr(s, field) for s in self._stats())
            return [Observation(value, LIBRARY_ATTRIBUTES)]

        return observe

    def _observe_blocked(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            value = self._retired[BLOCKED_TIME] + sum(m.blocked_time() for m in self._members)
        return [Observation(value, LIBRARY_ATTRIBUTES)]


def _histogram(meter: Meter) -> Histogram:
    return meter.create_histogram(
        OPERATION_DURATION,
        unit="s",
        description="Time from publish() to the message's resolution (confirm or failure).",
        explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
    )


# One Instruments per meter provider, for the life of the provider.
_by_provider: weakref.WeakKeyDictionary[MeterProvider, Instruments] = weakref.WeakKeyDictionary()
_strong: dict[int, tuple[MeterProvider, Instruments]] = {}  # providers that refuse weak refs
_registry_lock = threading.Lock()


def instruments_for(provider: MeterProvider, meter: Meter) -> Instruments:
    """The shared instruments of ``provider`` (created with ``meter`` the first time)."""
    with _registry_lock:
        try:
            found = _by_provider.get(provider)
        except TypeError:
            held = _strong.get(id(provider))
            found = held[1] if held is not None else None
        if found is None:
            found = Instruments(meter)
            try:
                _by_provider[provider] = found
            except TypeError:
                _strong[id(provider)] = (provider, found)
        return found
