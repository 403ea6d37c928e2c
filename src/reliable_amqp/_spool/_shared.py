"""What a spool's two sides share: the caller's thread and the writer thread, and nothing else.

:class:`~reliable_amqp._spool._store.Spool` is the caller's side (append, back-pressure,
persist, reading back, close); :class:`~reliable_amqp._spool._writer.SpoolWriter` is the writer
thread's (taking, writing, segments, ledger, shutdown). Each keeps its own state to itself;
every value that crosses from one to the other is a field of :class:`Shared`, one object both
hold.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reliable_amqp._core.message import MessageParts
from reliable_amqp._spool._files import Removed, Segment

#: bytes queued for the writer at most: beyond, append() waits for the disk (a producer faster
#: than the disk would otherwise hold the difference in memory); the writer cuts its linger
#: short from half of it
QUEUE_MAX_BYTES = 8 * 1024 * 1024

#: a queued failure: (seq, message, reason)
Fail = tuple[int, MessageParts, str]


@dataclass(slots=True, eq=False)
class Shared:
    """The state the caller's thread and the writer thread share, under :attr:`lock`.

    "The caller" is whichever thread the publisher appends, removes, persists and reads from
    (one at a time: the sync publisher holds its handoff lock, the async one is on its loop).
    Each field says which side writes it and how. Appends and removals take no lock: a deque
    and counters, each counter written by one side only, which the other reads as it is (a
    value a moment old errs on the safe side: a little less room, a little more pending). What
    both sides write, or what must be seen together, changes under :attr:`lock`.
    """

    # --- the caller writes, with no lock ------------------------------------------------------
    #: the seq the next append gets (so ``next_seq - 1`` is the last one appended)
    next_seq: int
    #: bytes (as ``Spool.encode`` counts them) of every message ever appended, those found
    #: pending at opening included
    in_bytes: int
    #: whole records appended, in seq order, not yet taken by the writer (it pops them all at
    #: once): bytes only, no tuple a message for the garbage collector to track
    queue: deque[bytes] = field(default_factory=deque)
    #: confirmed messages to drop, (runs of seqs, how many seqs, their bytes); the writer pops
    #: them all at once
    removals: deque[tuple[list[tuple[int, int]], int, int]] = field(default_factory=deque)
    #: called on the writer thread after every batch it wrote, outside the lock (set by the
    #: publisher before it publishes)
    on_commit: Callable[[], None] | None = None

    # --- the writer writes, with no lock ------------------------------------------------------
    #: of :attr:`in_bytes`, what the writer has taken from :attr:`queue`
    out_bytes: int = 0
    #: seqs below :attr:`next_seq` that are no longer pending (removed or failed; those gone
    #: before opening included); under the lock when a failure adds to it
    freed_count: int = 0
    #: of :attr:`in_bytes`, what was removed or failed; under the lock when a failure adds to it
    freed_bytes: int = 0

    # --- the caller writes, under the lock ----------------------------------------------------
    #: failures queued by ``Spool.fail``; the writer swaps the list for an empty one
    fails: list[Fail] = field(default_factory=list)
    #: the seq ``persist()`` waits for (0: none): the writer makes everything up to it durable
    persist_target: int = 0
    #: ``close()`` was called: appends are refused, the writer writes what is left and stops
    closing: bool = False
    #: ``close()`` timed out: the writer stops trying a write that fails
    abandon: bool = False

    # --- the writer writes, under the lock ----------------------------------------------------
    #: every append up to this seq is written (readable by ``Spool.read``), or was removed
    committed_seq: int = 0
    #: every append up to this seq is as durable as the fsync policy makes it: fsynced (with
    #: ``fsync="never"``: written)
    durable_seq: int = 0
    #: why the last write failed (a full disk, an I/O error); None once a write went through
    error: BaseException | None = None
    #: the writer thread has ended
    closed: bool = False
    #: messages moved to the failed log, and their bytes
    failed: int = 0
    failed_bytes: int = 0
    #: the segments that hold records, in order: the list, and each one's ``size`` and
    #: ``last`` (its ``synced`` is the writer's alone); ``Spool.read`` copies what it needs
    #: under the lock
    segments: list[Segment] = field(default_factory=list)
    #: the seqs that left the pending set (``Spool.read`` copies it under the lock)
    removed: Removed = field(default_factory=Removed)

    # --- the writer sets, the caller clears (:meth:`nudge`), under the lock --------------------
    #: the writer waits on :attr:`work` for anything to do: an append nudges it
    writer_idle: bool = False
    #: the writer waits on :attr:`work` for a batch to pile up: only persist(), close(), a
    #: failure and a writer falling behind nudge it
    lingering: bool = False

    # --- the lock and its conditions ----------------------------------------------------------
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the writer waits on it (for work, or for a batch to pile up)
    work: threading.Condition = field(init=False)
    #: the caller waits on it (for room, for the writer, for persist()); the writer notifies it
    #: after every batch and every failed write
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.work = threading.Condition(self.lock)
        self.changed = threading.Condition(self.lock)

    @property
    def pending(self) -> int:
        """Messages in the spool (appended and not yet removed or failed)."""
        return self.next_seq - 1 - self.freed_count

    @property
    def pending_bytes(self) -> int:
        """Bytes counted against the spool's limit: stored record plus body of each pending
        message."""
        return self.in_bytes - self.freed_bytes

    @property
    def queued_bytes(self) -> int:
        """Bytes appended and not yet taken by the writer."""
        return self.in_bytes - self.out_bytes

    def nudge(self) -> None:
        """Under the lock: have the writer go now (it is idle, or letting a batch pile up)."""
        if self.writer_idle or self.lingering:
            # notify first: a KeyboardInterrupt inside notify() (Condition's Python code) must
            # leave the flags saying "idle", so that the next nudge notifies again; cleared
            # first, they said "awake" while the writer slept on, and every later nudge, the
            # close's too, skipped it (the interrupt sweep's point 30: the spool never closed)
            self.work.notify()
            self.writer_idle = self.lingering = False
