"""What a publisher with a spool keeps beside its window: the bookkeeping both adapters share.

Every message a spooled publisher accepts is appended to the spool first (its ``seq`` is its
place in the append order) and goes to the engine in that order:

- at once, when nothing older waits on disk and the in-flight window has room (the usual case:
  the message never has to be read back);
- otherwise it stays on disk only (the *backlog*: messages recovered from an earlier process, and
  whatever did not fit in the window during an outage), and the adapter reads it back, in order,
  as the window frees room (:meth:`SpoolFeed.issue_read`). Memory holds at most a window of messages
  however long the outage. A backlog message published here keeps its future in memory only
  while someone else does (:attr:`SpoolFeed.waiting`, pruned as it grows): a future the caller
  keeps, awaits or gave a done-callback still resolves; one the caller dropped costs nothing
  (its message is read back from disk). Weak references would not do: a caller that only adds
  a done-callback and drops the future expects the callback to run.

Recovered messages are *held* until the caller's first ``publish()``, ``flush()`` or
``close()`` (:meth:`SpoolFeed.release`): the declarations a caller makes before those are in
place when they go out, so a recovered message is never confirmed into an exchange with no
queue yet. They go out ``mandatory`` (:meth:`SpoolFeed.read`): one that still reaches no queue
is returned, and lands in the failed table.

When the engine resolves a message, :meth:`SpoolFeed.resolved` decides what the spool does with
it: a confirmed one is removed; one that failed with an error its caller holds (nacked,
returned, rejected, timed out) is removed too; a recovered one (no caller) that failed goes to
the failed table and is reported; one that failed with ``PublisherClosed`` (the publisher
closed or gave up before the broker confirmed it) stays in the spool for the next publisher.

Not thread-safe: the sync publisher calls it under its handoff lock, the async one on its loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import PublisherClosed, PublishError
from reliable_amqp._core.message import MessageParts
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.window import Window
from reliable_amqp._spool._codec import Build
from reliable_amqp._spool._read import SpoolEntry
from reliable_amqp._spool._store import Spool, encode_record

H = TypeVar("H")

log = logging.getLogger("reliable_amqp")

#: entries read back from the spool at a time, at most
READ_CHUNK = 1000
#: how long a spooled publish() waits for room in a full window before it takes the broker for
#: stalled and leaves messages on disk without waiting (:meth:`SpoolFeed.pace_until`)
PACE_WAIT = 1.0
#: the bits of a packed (size, seq) that hold the seq (seqs stay far below 2**48)
SEQ_BITS = 48
SEQ_MASK = (1 << SEQ_BITS) - 1
#: waiting futures are pruned of the dropped ones when there are this many more than after the
#: last pruning (and at least this many): pruning costs O(1) a message, memory stays bounded
PRUNE_MIN = 4096


def _refcounts(handles: Mapping[int, object]) -> list[tuple[int, int]]:
    """(seq, reference count) of each handle; the same code measures :data:`_UNREFERENCED`."""
    return [(seq, sys.getrefcount(handle)) for seq, handle in handles.items()]


#: the reference count :func:`_refcounts` reports for a handle that only the dict holds
_UNREFERENCED = _refcounts({0: object()})[0][1]


class SpoolFeed(Generic[H]):
    """Which messages are on disk only, which seq each message in memory has, what ``flush()``
    waits for (see the module docstring)."""

    @classmethod
    def open(cls, options: PublisherOptions, watched: Callable[[H], bool]) -> SpoolFeed[H]:
        """The feed of a publisher's spool (``options.spool``, opened with its size and fsync
        options: its lock taken, or :class:`SpoolError`). Messages an earlier process left
        there are announced in the log: they go out first."""
        assert options.spool is not None
        spool = Spool(options.spool, max_bytes=options.spool_max_bytes, fsync=options.spool_fsync)
        if spool.pending:
            log.warning(
                "reliable-amqp: spool %s holds %d messages from before: they go out first, "
                "with the first publish(), flush() or close() (declare what they need before)",
                spool.directory,
                spool.pending,
            )
        return cls(spool, watched)

    def __init__(self, spool: Spool, watched: Callable[[H], bool]) -> None:
        """``watched(handle)`` says whether a future has done-callbacks or waiters."""
        self.spool = spool
        self._watched = watched
        #: entries up to this seq were left by an earlier process: they have no caller future
        self.recovered_top = spool.last_seq
        #: every entry with a seq up to this one went to the engine (or never needs to)
        self.fed = 0
        #: futures (handles) of backlog messages published here, by seq (see the module
        #: docstring: pruned of those nobody else holds)
        self.waiting: dict[int, H] = {}
        self._prune_at = PRUNE_MIN
        #: the seq of each message in memory and its size against the spool's limit, by its
        #: window index (``Entry.index``), packed in one int (``size << SEQ_BITS | seq``: no
        #: tuple a message for the garbage collector to track, one dict operation); messages
        #: go to the engine in seq order, so the dict holds them in seq order too
        self._held: dict[int, int] = {}
        #: set when a read found fewer entries than the backlog holds: the rest are not
        #: committed yet, and the writer's next commit should wake the adapter
        self.want_commit = False
        #: recovered messages wait for :meth:`release` (the caller's declarations first)
        self.holding = spool.pending > 0
        #: set when the window stayed full for :data:`PACE_WAIT`: a publish no longer waits
        #: for room until something resolves (see :meth:`pace_until`)
        self.stalled = False

    def release(self) -> bool:
        """The caller published, flushed or closed: recovered messages may go out now.

        Returns whether they were held (the adapter then wakes its reader)."""
        holding = self.holding
        self.holding = False
        return holding

    # --- publishing -----------------------------------------------------------------------------

    def append_direct(self, message: MessageParts, window: Window) -> int:
        """The usual case of a publish, in one call: when nothing waits on disk ahead of it
        and ``window`` and the spool have room at once, append ``message`` to the spool, issue
        it in ``window`` and track it; its window index. 0 (and nothing issued)
        when it cannot go at once: the adapter's own path then waits, or parks it.

        Raises :class:`InvalidMessage` for a message the spool cannot store.
        """
        spool = self.spool
        meta = encode_record(message)
        body = message.body
        if spool.last_seq != self.fed:
            return 0
        body_size = len(body)
        index = window.try_issue(body_size)
        if not index:
            return 0
        try:
            size = len(meta) + body_size
            seq = spool.try_append(meta, body, size)
        except BaseException:
            # (a Ctrl-C, in the sync publisher's thread): the room goes back; a record the
            # append wrote before it is read back from disk, like any behind fed
            window.unissue(body_size)
            raise
        if not seq:
            window.unissue(body_size)
            return 0
        self._held[index] = size << SEQ_BITS | seq
        self.fed = seq
        return index

    def pace_until(self, window: Window, size: int, end: float, now: float) -> float:
        """When :meth:`append_direct` did not take a message (``size`` body bytes): until when
        its publish waits (a little) for room in ``window`` for it and those ahead of it on
        disk before it goes on: the end of that wait (``end`` the one a wait before this one
        had, 0.0 at first; ``now`` on the same clock), or 0.0 to go on now (and the broker is
        taken for :attr:`stalled` when the wait is over). The adapters differ only in how they
        wait (sync ``SpooledPublishing.publish``, async ``AsyncSpooled._keep_pace``).

        While the broker confirms, a spooled publish() keeps its pace as without a spool: the
        message goes straight to the engine and is never read back from disk (which costs more
        than the append). A backlog the window can take at once (the start, a short stall)
        counts against the room, so that it drains; a larger one (an outage's) does not: it is
        read back as fast as the broker takes it while publish() leaves new messages behind it.
        A window that frees no room within :data:`PACE_WAIT` means the broker is not confirming
        (down, blocked, frozen): from then on, until a confirm frees room, messages go to disk
        without waiting (:attr:`stalled`).
        """
        if self.stalled:
            return 0.0
        if window.fits(size) and window.free_slots() > self.ahead(window.max_count):
            return 0.0
        if not end:
            return now + PACE_WAIT
        if now >= end:
            self.stalled = True
            return 0.0
        return end

    def issue_appended(
        self, seq: int, size: int, window: Window, body_size: int, queued: bool = False
    ) -> int:
        """A message :meth:`append_direct` did not take, appended since as ``seq`` (``size``
        bytes against the spool's limit, ``body_size`` in the window): its window index when
        it goes to the engine at once (nothing older waits on disk, no publish is ``queued``
        for room ahead of it, the window has room), tracked; else 0, and the caller
        parks its handle (:meth:`park`)."""
        if queued or seq != self.fed + 1:
            return 0
        index = window.try_issue(body_size)
        if index:
            self._held[index] = size << SEQ_BITS | seq
            self.fed = seq
        return index

    def park(self, handle: H, seq: int, window: Window) -> bool:
        """``handle``'s message (``seq``) stays on disk until there is room for it. Returns
        whether ``window`` has room now: the adapter then has the backlog read back."""
        waiting = self.waiting
        waiting[seq] = handle
        if len(waiting) >= self._prune_at:
            self.prune()
        return window.free_slots() > 0

    def prune(self) -> None:
        """Forget the waiting futures nobody else references and nobody watches: their
        messages are read back from disk (with a handle of the adapter's) when their turn
        comes. CPython's reference counts tell; the dict's own reference is the baseline."""
        waiting = self.waiting
        watched = self._watched
        for seq, count in _refcounts(waiting):
            if count <= _UNREFERENCED and not watched(waiting[seq]):
                del waiting[seq]
        self._prune_at = max(PRUNE_MIN, 2 * len(waiting))

    def ahead(self, window_slots: int) -> int:
        """How many messages wait on disk ahead of a new one, when the window (of
        ``window_slots``) can take them all at once; 0 for a larger backlog (an outage's, read
        back at the broker's pace while publish() leaves new messages behind it)."""
        ahead = self.spool.last_seq - self.fed
        return ahead if ahead < window_slots else 0

    # --- reading back ---------------------------------------------------------------------------

    @property
    def backlog(self) -> bool:
        """Whether messages wait on disk to be read back now (not while held)."""
        return self.fed < self.spool.last_seq and not self.holding

    def read(self, room: int, build: Build) -> list[SpoolEntry]:
        """The next backlog entries, in order, at most ``room`` (and :data:`READ_CHUNK`), each
        message made by ``build`` as the adapter's engine entry (see :func:`_codec.decode`).
        A recovered message (left by an earlier process) goes out mandatory: if no queue takes
        it (the topology it was published for is gone), the broker returns it and it lands in
        the failed table, rather than being confirmed into nowhere.

        Reads the disk: the sync adapter calls it outside its lock (nothing else moves
        :attr:`fed` meanwhile: only the reading side does, and a publish goes to the backlog
        while there is one).
        """
        if room <= 0 or not self.backlog:
            return []
        spool = self.spool
        top = spool.last_seq  # before committed_seq: both only grow
        # before the read: every seq up to it is in what the read sees (read after, a commit
        # between the read and the check would pass for a gap, and its messages be skipped)
        committed = spool.committed_seq
        entries = spool.read(self.fed, min(room, READ_CHUNK), build)
        if not entries and committed >= top:
            # everything up to top is committed and none of it waits: the seqs between are
            # gone (confirmed before a crash, or in the failed table)
            self.fed = max(self.fed, top)
            self.want_commit = False
            return []
        last = entries[-1].seq if entries else self.fed
        # what the writer has not committed yet is read after its next commit
        self.want_commit = last < self.spool.last_seq and len(entries) < min(room, READ_CHUNK)
        if entries and entries[0].seq <= self.recovered_top:
            for entry in entries:
                if entry.seq <= self.recovered_top:
                    message = entry.message
                    assert isinstance(message, Entry)  # what build makes
                    message.mandatory = True
        return entries

    def issue_read(self, entries: Sequence[SpoolEntry], window: Window) -> list[H | None]:
        """Of ``entries`` (:meth:`read`), those that go to the engine now, in order, as many as
        ``window`` has room for: each message (the adapter's engine entry) gets its window
        index and is tracked. Returns, for each, the caller's handle if the caller still keeps
        it (None: recovered, or dropped: the adapter makes one)."""
        handles: list[H | None] = []
        held = self._held
        take = self.waiting.pop
        for seq, message, size in entries:
            body_size = len(message.body)
            if seq <= self.fed or not window.fits(body_size):
                break  # (a publish went ahead meanwhile; the window is full)
            assert isinstance(message, Entry)  # what the adapter's build makes
            message.index = index = window.issue(body_size)
            held[index] = size << SEQ_BITS | seq
            self.fed = seq
            handles.append(take(seq, None))
        return handles

    # --- resolving ------------------------------------------------------------------------------

    def resolved(self, entries: Iterable[Entry[Any]]) -> list[PublishError]:
        """Messages the engine resolved: remove, keep or move each one's spool entry.

        Returns the errors of the recovered messages that went to the failed table (the adapter
        reports them through ``on_event``, outside its lock).
        """
        self.stalled = False  # confirms flow: publishes keep pace again
        pop = self._held.pop
        mask = SEQ_MASK
        runs: list[tuple[int, int]] = []  # what leaves the spool, as runs of seqs
        low = high = -2
        count = removed_bytes = 0
        failed: list[PublishError] = []
        for entry in entries:
            packed = pop(entry.index, None)
            if packed is None:
                continue
            seq = packed & mask
            if not entry.ok:  # (ok: without building its Confirmation)
                result = entry.outcome
                if isinstance(result, PublisherClosed):
                    continue  # not settled by the broker: stays for the next publisher
                if seq <= self.recovered_top and isinstance(result, PublishError):
                    self.spool.fail(seq, entry.message, f"{type(result).__name__}: {result}")
                    failed.append(result)
                    continue
                # otherwise the caller holds the error, and the message with it: removed
            # confirms come in seq order: one run a batch, extended a message at a time
            if seq == high + 1:
                high = seq
            else:
                if high > 0:
                    runs.append((low, high))
                low = high = seq
            count += 1
            removed_bytes += packed >> SEQ_BITS
        if count:
            runs.append((low, high))
            self.spool.remove_runs(runs, count, removed_bytes)
        return failed

    def unresolved(self, mark: int) -> int:
        """Messages with a seq up to ``mark`` not resolved yet (in memory or on disk).

        The part on disk is counted from seqs (exact but for gaps a recovered spool may have).
        """
        on_disk = max(0, min(mark, self.spool.last_seq) - self.fed)
        if self.fed <= mark:  # every message in memory is up to the mark (the usual case)
            return on_disk + len(self._held)
        return on_disk + sum(1 for packed in self._held.values() if packed & SEQ_MASK <= mark)

    @property
    def held(self) -> int:
        """Spooled messages in memory (in the engine)."""
        return len(self._held)
