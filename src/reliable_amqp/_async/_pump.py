"""The async publisher's traffic: what goes to the broker and what comes back.

Every decision is the core :class:`Supervisor`'s (what to write next, what a confirm settles,
when to wake up); :class:`Pump` carries them out on aiormq while :class:`~._link.Link` keeps a
connection and a confirm channel open:

- the intake takes what ``publish()`` admitted (:meth:`Pump.take`) and gives the engine a whole
  run when the publishing task yields (:meth:`Pump.accept_pending`);
- the writer puts the frames of what the engine has to send on aiormq's write queue in batches,
  one batch per socket drain, so publishes that arrive meanwhile share the next write;
- one timer, set for the supervisor's next wake-up, expires deadlines, releases nack retries
  and checks that the broker is not silent;
- confirms and returns arrive through :class:`ConfirmChannel`'s reader (this is its
  :class:`~reliable_amqp._compat.aiormq.FrameSink`) and are settled at once.

All of this runs on one event loop, so the supervisor is never touched concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import aiormq.abc

from reliable_amqp._compat.aiormq import (
    ConfirmChannel,
    drop_silent,
    last_frame_time,
    wait_writable,
    write_payload,
)
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.tracker import ATTEMPT_HEADER

E = TypeVar("E", bound="Entry[Any]")

log = logging.getLogger("reliable_amqp")


class Pump(Generic[E]):
    """Moves messages between a :class:`Supervisor` and the channel :class:`~._link.Link`
    keeps open."""

    def __init__(self, supervisor: Supervisor[E], *, resolve: Callable[[list[E]], None]) -> None:
        self.supervisor = supervisor
        #: turns resolved entries into resolved futures (the publisher's)
        self.resolve = resolve
        #: the event loop, set when the link starts
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wakeup = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        #: the connection being served (the link sets it), for the liveness check, and why it
        #: was dropped (silent)
        self.watched: aiormq.abc.AbstractConnection | None = None
        self.silent: ReliableAmqpError | None = None
        #: admitted by publish(), not yet taken by the engine: taken in one call when the
        #: publishing task yields (:meth:`accept_pending`), not one engine call per message.
        #: Replaced, not emptied, when the engine takes it. ``AsyncPublisher.publish`` appends
        #: to it in line (:meth:`take`'s twin there).
        self.pending: list[E] = []
        #: an accept_pending is scheduled
        self.accept_due = False

    # --- the hand-over from publish() -----------------------------------------------------------

    def take(self, entry: E) -> Callable[[], None] | None:
        """The admission's hand-over of one admitted entry (its future set): it joins the run
        the engine takes when the publishing task next yields (:meth:`accept_pending`). Returns
        the wake-up to make (scheduling that), None when one is scheduled already."""
        self.pending.append(entry)
        return None if self.accept_due else self.accept_soon

    def take_run(self, entries: Sequence[E]) -> Callable[[], None]:
        """The admission's hand-over of a run (``publish_many()``, a spool's read back): to the
        engine at once, after what :meth:`take` holds (publish order is send order)."""
        self.accept_pending()
        self.supervisor.accept(entries, time.monotonic())
        return self.wake

    def holds(self, entry: E) -> bool:
        """Whether ``entry`` is the latest message handed over (an interrupted admission asks:
        see ``_core.admission``)."""
        pending = self.pending
        return (bool(pending) and pending[-1] is entry) or self.supervisor.holds(entry)

    def accept_soon(self) -> None:
        """Schedule :meth:`accept_pending` for when the publishing task yields (once a run)."""
        if not self.accept_due:
            assert self.loop is not None, "not started"
            self.loop.call_soon(self.accept_pending)
            self.accept_due = True

    def accept_pending(self) -> None:
        """Give the engine what :meth:`take` holds, in order, and wake the writer. Scheduled by
        the first :meth:`take` of a run; called before anything reads the engine's count of
        messages (stats, shutdown, a run handed over)."""
        self.accept_due = False
        pending = self.pending
        if not pending:
            return
        self.pending = []
        try:
            self.supervisor.accept(pending, time.monotonic())
        except BaseException:  # a KeyboardInterrupt: the run is whole in the engine or here
            if not self.supervisor.holds(pending[-1]):
                self.pending[:0] = pending
            raise
        self.wake()

    def wake(self) -> None:
        """Tell the writer there is something to send (and make sure deadlines have a timer)."""
        if not self._wakeup.is_set():
            self._wakeup.set()
        if self._timer is None:
            self.schedule()

    def rewake(self) -> None:
        """:meth:`wake` after a KeyboardInterrupt cut a publish short: set the wake-up afresh
        (an ``asyncio.Event.set()`` interrupted half-way stays set with its waiter asleep, and
        :meth:`wake` would not set it again)."""
        self._wakeup.clear()
        self.wake()
        if self.pending and not self.accept_due:
            self.accept_soon()  # the interrupt may have cut the take() that owed it

    # --- the timer -----------------------------------------------------------------------------

    def schedule(self) -> None:
        """Make sure the timer fires when the supervisor next has work."""
        due = self.supervisor.next_wakeup()
        timer = self._timer
        if due is None or self.loop is None or (timer is not None and timer.when() <= due):
            return
        if timer is not None:
            timer.cancel()
        # call_at takes the loop's clock; the supervisor's is time.monotonic (the same on every
        # platform asyncio supports, but convert the difference rather than assume it).
        loop = self.loop
        self._timer = loop.call_at(loop.time() + max(0.0, due - time.monotonic()), self._on_timer)

    def cancel_timer(self) -> None:
        """Stop the timer (the link is shutting down)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        watched = self.watched
        if watched is not None and self.silent is None and not watched.is_closed:
            silent = self.supervisor.check_liveness(last_frame_time(watched), now)
            if silent is not None:  # a frozen broker closes nothing: drop the link ourselves
                log.warning("reliable-amqp: %s", silent)
                self.silent = silent
                drop_silent(watched)
        self.resolve(self.supervisor.tick(now))
        if self.supervisor.has_sendable():
            self._wakeup.set()
        self.schedule()

    # --- FrameSink: called by the channel's reader task ----------------------------------------

    def on_confirm(self, generation: int, ack: bool, tag: int, multiple: bool) -> None:
        """``basic.ack``/``basic.nack`` from the channel of ``generation``."""
        isolating = self.supervisor.isolating
        self.resolve(self.supervisor.on_confirm(generation, ack, tag, multiple, time.monotonic()))
        if not ack:
            self.schedule()  # a nack retry may come due before anything else
        if isolating:
            # Suspects of a frame error go one at a time: the next one now (or, the last one
            # settled, everything that waited behind them).
            self._wakeup.set()

    def on_return(
        self,
        headers: Any,
        reply_code: int,
        text: str,
        returned: tuple[str | None, str, str, bytes],
        generation: int,
    ) -> None:
        """``basic.return``: the ack that follows settles the message as returned."""
        attempt = headers.get(ATTEMPT_HEADER) if isinstance(headers, dict) else None
        message_id, exchange, routing_key, body = returned
        self.supervisor.on_return(
            attempt,
            reply_code,
            text,
            returned=(message_id, exchange, routing_key, body, headers),
            generation=generation,
        )

    def on_blocked(self, blocked: bool, reason: str) -> None:
        """``connection.blocked``/``unblocked`` on the connection being served."""
        if blocked:
            self.supervisor.blocked(reason)
        elif self.supervisor.unblocked():
            self._wakeup.set()

    # --- the writer task -----------------------------------------------------------------------

    async def write(self, channel: ConfirmChannel) -> None:
        """Write what the engine has to send, in batches, for as long as ``channel`` is open."""
        connection = channel.connection
        number = channel.number
        generation = channel.generation
        supervisor = self.supervisor
        has_sendable = supervisor.has_sendable
        wakeup = self._wakeup
        while True:
            if not has_sendable():
                wakeup.clear()
                await wakeup.wait()
                continue
            await wait_writable(connection)  # shared with heartbeats and other channels
            # From this check to write_payload nothing yields: every message marked sent below is
            # written to a channel that was open, so the tracker's seqs are the broker's tags.
            if not channel.writable or generation != supervisor.generation:
                return
            if not supervisor.writable:  # blocked: wait for unblocked (or the channel's end)
                wakeup.clear()
                await wakeup.wait()
                continue
            parts: list[bytes | memoryview] = []
            _count, failed = supervisor.write(number, parts)
            self.resolve(failed)
            if not parts:
                if not failed:  # isolating: the next one waits for a confirm, which wakes us
                    wakeup.clear()
                    await wakeup.wait()
                continue
            drained = write_payload(connection, b"".join(parts))
            # Waiting until the socket took the batch is the backpressure; meanwhile new
            # publishes gather into the next batch.
            await drained
