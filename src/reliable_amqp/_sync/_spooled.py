"""The durable spool's part of the sync :class:`~reliable_amqp.Publisher` (``spool=DIR``).

``publish()`` appends the message to the spool and hands it to the I/O thread as without a
spool when nothing older waits on disk and the window has room; otherwise it leaves it on disk.
While the broker confirms, it keeps the broker's pace (``SpoolFeed.pace_until``); it never
waits for a broker that is down or stalled, only for room in the spool and for the disk. The
I/O thread reads the backlog back as the window frees room (:meth:`SpooledPublishing.refill`,
called where it takes the outbox), and every resolution goes through
:meth:`SpoolFeed.resolved` (from :meth:`Handoff.resolve`). Messages recovered from an earlier
process wait for the caller's first ``publish()``, ``flush()`` or ``close()``
(:meth:`SpoolFeed.release`), so that the declarations made before it are in place when they go
out. The bookkeeping, and what a spooled publish decides, is
:class:`~reliable_amqp._spool._feed.SpoolFeed`, shared with the async publisher.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from reliable_amqp._compat.futures import watched
from reliable_amqp._core.errors import PublisherClosed, PublishError
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.stats import EventKind
from reliable_amqp._core.window import Flush
from reliable_amqp._logs import report_spool_failed
from reliable_amqp._spool._feed import SpoolFeed
from reliable_amqp._sync._future import PublishFuture, future_factory

if TYPE_CHECKING:
    from reliable_amqp._core.lifecycle import Lifecycle
    from reliable_amqp._sync._handoff import Handoff


class SpooledPublishing:
    """A sync publisher's spool, its feed, and the calls its publisher and I/O thread make."""

    def __init__(self, options: PublisherOptions, handoff: Handoff, events: Lifecycle) -> None:
        self.options = options
        self.feed: SpoolFeed[PublishFuture] = SpoolFeed.open(options, watched)
        self.spool = self.feed.spool
        self._handoff = handoff
        self._events = events
        self.spool.on_commit = self._on_commit
        #: how a message read back is built: as its own future, like publish()'s
        self._build = future_factory(handoff.futures, handoff)

    @property
    def directory(self) -> str:
        """The spool's directory."""
        return self.spool.directory

    # --- the caller's side ----------------------------------------------------------------------

    def publish(
        self, entry: PublishFuture, check: Callable[[PublishFuture], None]
    ) -> PublishFuture:
        """Append ``entry``'s message to the spool and return it (see the module docstring).

        ``check`` raises when the publisher no longer accepts messages (closed, gave up).
        """
        feed = self.feed
        handoff = self._handoff
        if feed.holding:
            self.release()
        spool = self.spool
        window = handoff.window
        admission = handoff.admission  # (its fields, not Handoff's properties: the hot path)
        meta = b""  # the stored record, once the usual case did not take the message
        size = 0
        end = 0.0  # publish_timeout's deadline, once something waits
        pace = 0.0  # the end of a wait for room in the window (see SpoolFeed.pace_until)
        while True:
            waiter = None
            with handoff.lock:
                if admission.fatal is not None or not admission.accepting:
                    check(entry)
                # the usual case, in one call: nothing on disk ahead, room in the window and
                # in the spool (InvalidMessage for what cannot be stored): its window index
                index = feed.append_direct(entry, window)
                appended = index > 0  # (in the spool, whatever happens next)
                if not index:
                    if not meta:
                        meta, size = spool.encode(entry)
                    body_size = len(entry.body)
                    # keep the broker's pace (a callback on the I/O thread cannot: only that
                    # thread frees room)
                    if not feed.stalled and not handoff.on_io_thread():
                        pace = feed.pace_until(window, body_size, pace, time.monotonic())
                        if pace:  # wait for room, off the lock (see Handoff), and look again
                            waiter = handoff.waiter()
                if waiter is None and not index:
                    seq = spool.try_append(meta, entry.body, size)  # its spool seq, or 0
                    appended = seq > 0
                    if seq:
                        index = feed.issue_appended(seq, size, window, body_size)
                        # else it waits on disk, read back when confirms free room; when
                        # there is room now, the I/O thread is woken to read it back
                        if not index and not feed.park(entry, seq, window):
                            return entry
                    else:
                        spool.check_writable(entry)  # SpoolFull, closed: no waiting helps
                if index:
                    entry.index = index
                    handoff.outbox.append(entry)
                if appended:
                    wake = handoff.wake_call()
            if waiter is not None:
                handoff.wait(waiter, pace - time.monotonic())
                continue
            if appended:
                if wake is not None:
                    wake()
                return entry
            # no room in the spool, or its writer behind: wait, off the lock, and try again
            end = end or time.monotonic() + self.options.publish_timeout
            if time.monotonic() >= end:
                raise spool.timeout_error(size, self.options.publish_timeout)
            self._wait_for_spool(entry, size, check, end)

    def _wait_for_spool(
        self,
        entry: PublishFuture,
        size: int,
        check: Callable[[PublishFuture], None],
        end: float,
    ) -> None:
        """Wait for room in the spool (confirms make it) or for its writer (the disk)."""
        spool = self.spool
        if not spool.has_room(size):
            # only confirms make room, and only the I/O thread reads them
            self._handoff.check_wait("publish() into a full spool")
            check(entry)
            spool.wait_for_room(size, max(0.0, end - time.monotonic()))
        if spool.writer_behind:  # the disk is slower than the producer: wait for it
            spool.wait_for_writer(max(0.0, end - time.monotonic()))

    def flush(self, timeout: float | None) -> int:
        """Wait until every message published so far (and every recovered one) is resolved;
        return how many are not."""
        end = None if timeout is None else time.monotonic() + timeout
        handoff = self._handoff
        if self.feed.holding:
            self.release()
        with handoff.lock:
            mark = self.spool.last_seq
        unresolved = self.feed.unresolved
        return handoff.wait_out(Flush(lambda: unresolved(mark), end), poll=1.0)

    def release(self) -> None:
        """Let recovered messages go out (the caller's declarations are in place)."""
        with self._handoff.lock:
            released = self.feed.release()
        if released:
            self._handoff.wake()

    def persist(self, timeout: float | None) -> int:
        """Wait until everything published so far is durable; return how many are not."""
        self._handoff.check_wait("persist()")
        return self.spool.persist(timeout)

    def close(self, timeout: float) -> None:
        """After the I/O thread is gone: fail the futures of what stayed on disk (it stays in
        the spool for the next publisher), then close the spool (durably)."""
        feed = self.feed
        with self._handoff.lock:
            waiting = dict(feed.waiting)
            feed.waiting.clear()
        if waiting:
            self.spool.persist(timeout)
            stored = self.spool.committed_seq
            lost = "publisher closed; the spool could not store the message"
            for seq, future in waiting.items():
                if not future.done():
                    error = PublisherClosed(future.message, 0)
                    if seq <= stored:
                        error = error.kept_in_spool(self.spool.directory)
                    else:
                        error = PublisherClosed(future.message, 0, lost)
                    future.set_exception(error)
        self.spool.close(timeout)

    # --- the I/O thread's side ------------------------------------------------------------------

    def refill(self) -> list[PublishFuture]:
        """The backlog messages the window has room for now, read back in order: each the
        caller's future when the caller still holds it, else one built as it was read."""
        feed = self.feed
        if not feed.backlog:
            return []
        handoff = self._handoff
        window = handoff.window
        with handoff.lock:
            # publish() appends and feeds a message under this lock: seen outside it, a message
            # being published straight to the engine would look like a backlog
            if not feed.backlog:
                return []
            room = window.free_slots()
        entries = feed.read(room, self._build)  # the disk, outside the lock
        if not entries:
            return []
        items: list[PublishFuture] = []
        with handoff.lock:
            # (issue_read's handles: one for each of the first entries, as many as go now)
            for entry, kept in zip(entries, feed.issue_read(entries, window), strict=False):
                read = entry.message
                assert isinstance(read, PublishFuture)  # what self._build makes
                future = kept
                if future is None:  # recovered, or the caller dropped its future
                    future = read
                    if entry.seq <= feed.recovered_top:
                        future._report = False  # a failure is the spool's to report
                else:
                    future.index = read.index
                items.append(future)
        return items

    def resolved_locked(self, resolved: list[PublishFuture]) -> list[PublishError]:
        """Called by :meth:`Handoff.resolve` under its lock, before flushes are woken."""
        return self.feed.resolved(resolved)

    def after_resolved(self, failed: list[PublishError]) -> None:
        """Called by :meth:`Handoff.resolve` after its lock: report, and read more back."""
        for error in failed:  # no caller holds them: one WARNING each (docs/observability.md)
            detail = report_spool_failed(error, error.message.message_id)
            self._events.emit(EventKind.SPOOL_FAILED, detail, error=error)
        if self.feed.backlog:
            self._handoff.wake()

    def _on_commit(self) -> None:
        # the writer's thread: a read that found the backlog uncommitted can go on now
        if self.feed.want_commit:
            self.feed.want_commit = False
            self._handoff.wake()
