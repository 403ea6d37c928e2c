"""The in-flight window and ``flush()`` accounting, one algorithm for both publishers.

The window bounds what a publisher holds unresolved (``max_in_flight`` messages,
``max_in_flight_bytes`` body bytes, one larger message let through alone). ``flush()`` waits on a
:class:`Barrier`: the number of messages issued up to the moment it was called that are still
unresolved, counted down as they resolve, so a flush never waits for publishes that came after it.

Not locked: the sync publisher holds its window lock around every call, the async publisher runs
on one event loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from reliable_amqp._core.errors import PublishTimeout


class Resolved(Protocol):
    """A resolved message as the window sees it (an engine entry)."""

    @property
    def size(self) -> int:
        """Its body's size in bytes."""

    @property
    def index(self) -> int:
        """Its issue number."""


class Issued(Protocol):
    """A message as the window issues it: its size counted, its issue number given."""

    @property
    def size(self) -> int:
        """Its body's size in bytes."""

    index: int


class Barrier:
    """One ``flush()`` under way: messages issued up to ``mark`` not yet resolved."""

    __slots__ = ("mark", "remaining", "waiter")

    def __init__(self, mark: int, remaining: int) -> None:
        self.mark = mark
        self.remaining = remaining
        #: the adapter's wake-up for this flush (an asyncio future); unused by the core
        self.waiter: object = None


class Flush:
    """One ``flush()`` under way, decided once for both publishers and for both counts (a
    :class:`Barrier`'s, the spool's): how many of the messages it waits for are unresolved,
    and whether it is over (none left, or its timeout passed). The publishers differ only in
    how they wait between two looks (a thread on a waiter off its lock; a task on a future).

    ``unresolved()`` counts what is left; ``end`` is the deadline on the publisher's clock
    (None: none)."""

    __slots__ = ("end", "left", "unresolved")

    def __init__(self, unresolved: Callable[[], int], end: float | None) -> None:
        self.unresolved = unresolved
        self.end = end
        #: what was left at the last :meth:`wait_for`: what ``flush()`` returns once it is over
        self.left = 0

    def wait_for(self, now: float) -> float | None:
        """How long to wait before looking again (None: as long as it takes), or 0.0 when
        the flush is over: :attr:`left` is then what ``flush()`` returns."""
        left = self.left = max(0, self.unresolved())
        end = self.end
        if left == 0:
            return 0.0
        if end is None:
            return None
        return max(0.0, end - now)


class Window:
    """Counts of unresolved messages and bytes, issue numbers, and the flushes waiting."""

    __slots__ = ("_barriers", "bytes", "count", "issued", "max_bytes", "max_count")

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        #: unresolved messages and their body bytes
        self.count = 0
        self.bytes = 0
        #: messages issued so far; a message's index is the value after its own issue
        self.issued = 0
        self._barriers: list[Barrier] = []

    def fits(self, size: int) -> bool:
        """Whether a message of ``size`` body bytes may be taken in now."""
        return self.count < self.max_count and (
            self.bytes + size <= self.max_bytes or self.count == 0
        )

    def try_issue(self, size: int) -> int:
        """:meth:`issue` if the message :meth:`fits` now (its index), else 0: one call where a
        publisher holds its lock."""
        count = self.count
        if count < self.max_count and (self.bytes + size <= self.max_bytes or count == 0):
            self.count = count + 1
            self.bytes += size
            self.issued = issued = self.issued + 1
            return issued
        return 0

    def unissue(self, size: int) -> None:
        """Take back the latest :meth:`try_issue` (of ``size``): its message went nowhere.
        Only right when nothing was issued since."""
        self.count -= 1
        self.bytes -= size
        self.issued -= 1

    def issue(self, size: int) -> int:
        """Count one more unresolved message; return its index."""
        self.count += 1
        self.bytes += size
        self.issued += 1
        return self.issued

    def issue_run(self, entries: Sequence[Issued], start: int = 0) -> int:
        """Count as many of ``entries[start:]`` as fit now (at least one when the window is
        empty), giving each its issue number (``index``) in order; return how many."""
        count = self.count
        room = self.max_count - count
        end = min(len(entries), start + room)
        if end <= start:
            return 0
        total = self.bytes
        limit = self.max_bytes
        issued = self.issued
        taken = start
        for entry in itertools.islice(entries, start, end):
            size = entry.size
            # the first message of an empty window goes through alone, whatever its size
            if total + size > limit and (count or taken > start):
                break
            total += size
            taken += 1
            issued += 1
            entry.index = issued
        self.count = count + taken - start
        self.bytes = total
        self.issued = issued
        return taken - start

    def free_slots(self) -> int:
        """How many more messages the count bound admits (the byte bound aside)."""
        return self.max_count - self.count

    def release(self, resolved: Sequence[Resolved]) -> list[Barrier]:
        """Messages resolved; returns the barriers that reached zero with them."""
        self.count -= len(resolved)
        self.bytes -= sum([r.size for r in resolved])
        if not self._barriers:
            return []
        cleared: list[Barrier] = []
        for barrier in self._barriers:
            mark = barrier.mark
            barrier.remaining -= sum(1 for r in resolved if r.index <= mark)
            if barrier.remaining <= 0:
                cleared.append(barrier)
        if cleared:  # they count nothing more (one a Ctrl-C kept from its end_barrier goes too)
            self._barriers = [b for b in self._barriers if b.remaining > 0]
        return cleared

    def barrier(self) -> Barrier:
        """Start a flush: every message unresolved now was issued before it."""
        barrier = Barrier(self.issued, self.count)
        if barrier.remaining > 0:
            self._barriers.append(barrier)
        return barrier

    def end_barrier(self, barrier: Barrier) -> None:
        """The flush is over (done or timed out); stop counting for it (a barrier that reached
        zero went already: :meth:`release`)."""
        if barrier in self._barriers:
            self._barriers.remove(barrier)

    def full_error(self, waited: float) -> PublishTimeout:
        """The error ``publish()`` raises after waiting ``waited`` seconds for room."""
        return PublishTimeout(
            f"in-flight window full for {waited:g} s "
            f"({self.count} messages, {self.bytes} bytes unconfirmed; "
            f"max_in_flight={self.max_count}, max_in_flight_bytes={self.max_bytes})"
        )
