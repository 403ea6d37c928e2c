"""What a relay decides, without a database or a broker: which partitions to own, where to read
next, which rows are in flight, and what an outcome means for a row.

**Nothing skipped, without a cursor that can skip.** Rows commit out of id order (a transaction
that took id 1 may commit after the one that took id 2), so "id > last seen" would pass over a
row that was still invisible when the reader went by. The relay reads forward by id only within
one pass; a pass ends when a read comes back short (the relay has caught up) or after
``rescan_interval``, and the next pass starts again from the lowest pending id, skipping the rows
already in flight. A row that committed late is thus read on the next pass: never skipped, at
worst one pass late. Confirmed rows are deleted, so a pass from the bottom walks only what is
pending (in flight or not yet read).

**Per-key order with several relays.** Every row belongs to one of
:data:`~reliable_amqp.outbox._schema.PARTITIONS` partitions (its key's hash); a relay publishes
only the partitions it holds a lock on, and the lock dies with the relay's database session
(PostgreSQL advisory locks; SQLite: a file lock, one relay at a time), so two relays never own one
partition and a dead relay's partitions are free at once: no heartbeats, no split brain. Relays
share the partitions evenly: each aims at ``ceil(PARTITIONS / relays)``; one that holds more
stops reading the surplus, waits until its rows in flight there are settled, then unlocks it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from reliable_amqp._core.errors import (
    DeliveryTimeout,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    PublishError,
)
from reliable_amqp.outbox._schema import PARTITIONS


class Ownership:
    """The partitions a relay holds, the ones it is giving up, and what to do next."""

    def __init__(self, offset: int = 0, partitions: int = PARTITIONS) -> None:
        #: where this relay starts looking for free partitions (relays started together then
        #: try different ones first)
        self.offset = offset % partitions
        self.partitions = partitions
        self.owned: set[int] = set()
        #: owned partitions being given up: not read any more, unlocked once nothing of theirs
        #: is in flight
        self.draining: set[int] = set()

    def target(self, relays: int) -> int:
        """How many partitions one of ``relays`` relays should own."""
        return math.ceil(self.partitions / max(1, relays))

    def wanted(self, relays: int) -> list[int]:
        """Partitions to try to lock now, in order (empty when this relay holds enough)."""
        room = self.target(relays) - len(self.owned - self.draining)
        if room <= 0:
            return []
        order = [(self.offset + i) % self.partitions for i in range(self.partitions)]
        return [p for p in order if p not in self.owned][: self.partitions]

    def surplus(self, relays: int) -> list[int]:
        """Owned partitions to give up now (start draining them)."""
        active = sorted(self.owned - self.draining, key=self._distance)
        extra = len(active) - self.target(relays)
        return active[len(active) - extra :] if extra > 0 else []

    def _distance(self, part: int) -> int:
        return (part - self.offset) % self.partitions

    def readable(self) -> list[int] | None:
        """The partitions to read (None: all of them, no filter needed)."""
        active = self.owned - self.draining
        if len(active) == self.partitions:
            return None
        return sorted(active)

    def acquired(self, parts: Iterable[int]) -> None:
        self.owned.update(parts)

    def drain(self, parts: Iterable[int]) -> None:
        self.draining.update(p for p in parts if p in self.owned)

    def released(self, parts: Iterable[int]) -> None:
        for p in parts:
            self.owned.discard(p)
            self.draining.discard(p)

    def lost_all(self) -> None:
        """The database session (and every lock with it) is gone."""
        self.owned.clear()
        self.draining.clear()


class ReadCursor:
    """Where the next read starts (see the module docstring: passes, never a lasting cursor)."""

    def __init__(self, rescan_interval: float = 1.0) -> None:
        self.rescan_interval = rescan_interval
        #: read rows with ids above this; 0: a new pass from the bottom
        self.after = 0
        self._pass_started = 0.0
        #: passes begun (for tests and stats)
        self.passes = 0

    def start(self, now: float) -> int:
        """The id to read after, starting a new pass when one is due."""
        if self.after and now - self._pass_started >= self.rescan_interval:
            self.after = 0
        if self.after == 0:
            self._pass_started = now
            self.passes += 1
        return self.after

    def read(self, ids: Sequence[int], limit: int) -> None:
        """A read of at most ``limit`` rows returned ``ids`` (ascending)."""
        if len(ids) < limit:
            self.after = 0  # caught up: the next read is a new pass
        else:
            self.after = ids[-1]

    def restart(self) -> None:
        """Begin a new pass at the next read (ownership changed, the database came back)."""
        self.after = 0


def failure_reason(exc: BaseException) -> str | None:
    """What a row's failed publish means: the reason it moves to the failed table, or None
    when it stays pending and is published again (the broker may take it later)."""
    if isinstance(exc, MessageReturned | MessageRejected | MessageNacked):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, DeliveryTimeout | PublishError):
        return None  # not settled (timeout, publisher closed): still pending, try again
    return None


def attempts_of(exc: BaseException) -> int:
    """How often the message went out before it failed (1 when not known)."""
    return max(1, int(getattr(exc, "attempts", 1) or 1))


def id_ranges(ids: Iterable[int]) -> tuple[list[int], list[int]]:
    """``ids`` as runs of consecutive integers: (lows, highs), each run ``lows[i]..highs[i]``
    inclusive. Rows in flight were read in id order, so a window of thousands of ids is a few
    runs: a read that skips them compares each row with a few ranges, not thousands of ids."""
    lows: list[int] = []
    highs: list[int] = []
    for value in sorted(ids):
        if highs and value == highs[-1] + 1:
            highs[-1] = value
        else:
            lows.append(value)
            highs.append(value)
    return lows, highs
