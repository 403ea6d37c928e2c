"""The durable spool's part of :class:`~reliable_amqp.AsyncPublisher` (``spool=DIR``).

As for the sync publisher (:mod:`reliable_amqp._sync._spooled`): ``publish()`` appends the
message to the spool and hands it to the engine when nothing older waits on disk and the window
has room, else leaves it on disk; the backlog is read back in order as messages resolve and
free room; every resolved entry goes through :meth:`SpoolFeed.resolved`. Recovered messages
wait for the caller's first ``publish()``, ``flush()`` or ``aclose()`` (:meth:`SpoolFeed.release`).
Everything runs on the publisher's event loop but the spool's writer, whose commits wake the
loop when a read back found the backlog not yet committed, and the waits that block (room in
the spool, ``persist()``, closing), which run in the loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from reliable_amqp._compat.futures import watched_async
from reliable_amqp._core.admission import HandOverRun
from reliable_amqp._core.entry import Entry, new_entry
from reliable_amqp._core.errors import PublisherClosed
from reliable_amqp._core.message import Confirmation, OutgoingMessage, as_message
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.stats import EventKind
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.window import Flush, Window
from reliable_amqp._logs import report_spool_failed
from reliable_amqp._spool._feed import SpoolFeed

# The async publisher's types (reliable_amqp._async.publisher.Handle and AsyncEntry, which
# imports this module), spelled out
_Handle = asyncio.Future[Confirmation]
_AsyncEntry = Entry[_Handle]


class AsyncSpooled:
    """An async publisher's spool, its feed, and the calls its publisher makes."""

    def __init__(
        self,
        options: PublisherOptions,
        supervisor: Supervisor[_AsyncEntry],
        window: Window,
        hand_over: HandOverRun[_AsyncEntry],
    ) -> None:
        self.options = options
        self.feed: SpoolFeed[_Handle] = SpoolFeed.open(options, watched_async)
        self.spool = self.feed.spool
        self._supervisor = supervisor
        self._window = window
        #: the publisher's hand-over (its admission's): entries to the engine; the wake-up
        self._hand_over = hand_over
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refill_due = False
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._room_waiters: list[asyncio.Future[None]] = []
        self.spool.on_commit = self._on_commit

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The publisher runs on ``loop`` now: read back what waits (recovered messages)."""
        self._loop = loop
        self.schedule_refill()

    # --- publishing -----------------------------------------------------------------------------

    def publish_now(self, entry: _AsyncEntry, queued: bool) -> _Handle | None:
        """The usual case, with no coroutine: nothing on disk ahead, room in the window and in
        the spool: append ``entry`` and hand it to the engine; its future. None when
        :meth:`publish` has to wait (or park it): the caller awaits that instead. The caller
        checked that the publisher accepts messages; ``queued``: publishes wait for room in the
        window (they go first)."""
        feed = self.feed
        loop = self._loop
        if queued or feed.holding or loop is None:
            return None
        index = feed.append_direct(entry, self._window)  # InvalidMessage: cannot be stored
        if not index:
            return None
        return self._hand_over_one(entry, index, loop)

    async def publish(
        self,
        entry: _AsyncEntry,
        check: Callable[[_AsyncEntry], None],
        queued: Callable[[], bool],
    ) -> _Handle:
        """Append ``entry`` to the spool; its future (see the module docstring).

        ``check`` raises when the publisher no longer accepts messages; ``queued`` says whether
        publishes wait for room in the window (they go first).
        """
        spool = self.spool
        loop = asyncio.get_running_loop()
        if self.feed.holding:
            self.release()
        meta, size = spool.encode(entry)  # InvalidMessage for what cannot be stored
        timeout = self.options.publish_timeout
        end = loop.time() + timeout
        body_size = len(entry.body)
        window = self._window
        feed = self.feed
        # publish_now() did not take it: keep the broker's pace while something is ahead of it
        if not feed.stalled:
            await self._keep_pace(body_size, loop)
        while True:
            check(entry)
            seq = spool.try_append(meta, entry.body, size)
            if seq:
                break
            spool.check_writable(entry)  # SpoolFull, closed: no waiting helps
            if spool.writer_behind:  # the disk is slower than the producer: wait off the loop
                await loop.run_in_executor(None, spool.wait_for_writer, 1.0)
                continue
            left = end - loop.time()
            if left <= 0:
                raise spool.timeout_error(size, timeout)
            # only confirms make room: wait for them off the loop (which settles them)
            await loop.run_in_executor(None, spool.wait_for_room, size, min(left, 1.0))
        index = feed.issue_appended(seq, size, window, body_size, queued())
        if index:
            return self._hand_over_one(entry, index, loop)
        # left on disk: read back when confirms free room (or now, if there is room), its
        # future kept till then
        future = loop.create_future()
        if feed.park(future, seq, window):
            self.schedule_refill()
        return future

    def _hand_over_one(
        self, entry: _AsyncEntry, index: int, loop: asyncio.AbstractEventLoop
    ) -> _Handle:
        """Give ``entry`` to the engine with its issue number ``index`` and a new future of
        ``loop`` as its handle; that future (the caller's)."""
        entry.handle = future = loop.create_future()
        entry.index = index
        wake = self._hand_over((entry,))
        if wake is not None:
            wake()
        return future

    async def _keep_pace(self, size: int, loop: asyncio.AbstractEventLoop) -> None:
        """Wait (a little) while the window has no room for this message and those ahead of it
        on disk, as :meth:`SpoolFeed.pace_until` decides (and says why)."""
        window = self._window
        feed = self.feed
        end = 0.0
        while True:
            now = loop.time()
            end = feed.pace_until(window, size, end, now)
            if not end:
                return
            waiter: asyncio.Future[None] = loop.create_future()
            self._room_waiters.append(waiter)
            try:
                await asyncio.wait({waiter}, timeout=end - now)
            finally:
                if waiter in self._room_waiters:
                    self._room_waiters.remove(waiter)

    async def flush(self, timeout: float | None) -> int:
        """Wait until every message published so far (and every recovered one) is resolved;
        return how many are not."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        if self.feed.holding:
            self.release()
        mark = self.spool.last_seq
        unresolved = self.feed.unresolved
        flush = Flush(lambda: unresolved(mark), end)
        while (wait := flush.wait_for(loop.time())) != 0.0:
            waiter: asyncio.Future[None] = loop.create_future()
            self._flush_waiters.append(waiter)  # set by resolved()
            try:
                await asyncio.wait({waiter}, timeout=wait)
            finally:
                if waiter in self._flush_waiters:
                    self._flush_waiters.remove(waiter)
        return flush.left

    def release(self) -> None:
        """Let recovered messages go out (the caller's declarations are in place)."""
        if self.feed.release():
            self.schedule_refill()

    async def persist(self, timeout: float | None) -> int:
        """Wait until everything published so far is durable; return how many are not."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.spool.persist, timeout)

    async def aclose(self, timeout: float) -> None:
        """After the engine closed: fail the futures of what stayed on disk (it stays in the
        spool for the next publisher), then close the spool (durably)."""
        loop = asyncio.get_running_loop()
        waiting = dict(self.feed.waiting)  # the futures the callers still keep
        self.feed.waiting.clear()
        if waiting:
            await loop.run_in_executor(None, self.spool.persist, timeout)
            directory = self.spool.directory
            after = min(waiting) - 1
            while waiting and (entries := self.spool.read(after, 1000)):
                for entry in entries:
                    future = waiting.pop(entry.seq, None)
                    if future is not None and not future.done():
                        closed = PublisherClosed(as_message(entry.message), 0)
                        future.set_exception(closed.kept_in_spool(directory))
                after = entries[-1].seq
            for future in waiting.values():  # never written (the disk failed): say so
                if not future.done():
                    future.set_exception(
                        PublisherClosed(
                            OutgoingMessage("", "", b""),
                            0,
                            "publisher closed; the spool could not store the message",
                        )
                    )
        await loop.run_in_executor(None, self.spool.close, timeout)

    # --- reading back and resolving -------------------------------------------------------------

    def schedule_refill(self) -> None:
        """Read the backlog back soon (once, however many ask)."""
        loop = self._loop
        if self._refill_due or loop is None or not self.feed.backlog:
            return
        self._refill_due = True
        loop.call_soon(self._refill)

    def _refill(self) -> None:
        self._refill_due = False
        feed = self.feed
        window = self._window
        loop = self._loop
        if loop is None or not feed.backlog or self._supervisor.stopping:
            return
        # at most READ_CHUNK: a few ms of the loop; each message built as the engine's entry
        entries = feed.read(window.free_slots(), new_entry)
        if not entries:
            return
        items: list[_AsyncEntry] = []
        # (issue_read's handles: one for each of the first entries, as many as go now)
        for entry, kept in zip(entries, feed.issue_read(entries, window), strict=False):
            read = entry.message
            assert isinstance(read, Entry)  # what new_entry makes
            future = kept
            if future is None:  # recovered, or the caller dropped it
                future = loop.create_future()
                if entry.seq <= feed.recovered_top:
                    # nobody awaits it, and a failure is the spool's to report (resolved()):
                    # no "never retrieved" besides. One the caller dropped reports as any
                    # future dropped unretrieved.
                    future.add_done_callback(_discard_outcome)
            read.handle = future
            items.append(read)
        if items:
            wake = self._hand_over(items)
            if wake is not None:
                wake()
            if window.free_slots() > 0:
                self.schedule_refill()  # more room: the next chunk after what is queued

    def resolved(self, resolved: list[_AsyncEntry]) -> None:
        """The publisher resolved the futures of ``resolved`` and freed their room."""
        for error in self.feed.resolved(resolved):
            # no caller holds them: one WARNING each (docs/observability.md)
            detail = report_spool_failed(error, error.message.message_id)
            self._supervisor.events.emit(EventKind.SPOOL_FAILED, detail, error=error)
        waiters, self._flush_waiters = self._flush_waiters, []
        if self._room_waiters:
            waiters += self._room_waiters
            self._room_waiters = []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.schedule_refill()

    def _on_commit(self) -> None:
        # the writer's thread: a read that found the backlog uncommitted can go on now
        loop = self._loop
        if self.feed.want_commit and loop is not None:
            self.feed.want_commit = False
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self.schedule_refill)


def _discard_outcome(future: asyncio.Future[Confirmation]) -> None:
    if not future.cancelled():
        future.exception()
