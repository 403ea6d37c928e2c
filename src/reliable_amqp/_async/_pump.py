"""The async publisher's tasks: one that keeps a connection and channel, a writer, and a timer.

Every decision is the core :class:`Supervisor`'s (which URL next and when, give up or not, what a
closed channel means, when to wake up); this module carries them out on aiormq:

- the connection task obtains a connection (its own, or a borrowed one), replays declared
  topology on a new connection, opens the confirm channel, and reports every loss;
- the writer puts the frames of what the engine has to send on aiormq's write queue in batches,
  one batch per socket drain, so publishes that arrive meanwhile share the next write;
- one timer, set for the supervisor's next wake-up, expires deadlines and releases nack retries.

Confirms and returns arrive through :class:`ConfirmChannel`'s reader and are settled at once.
All of this runs on one event loop, so the supervisor is never touched concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import aiormq.abc

from reliable_amqp._async import _topology
from reliable_amqp._async._connect import ConnectionSource, loop_is_running
from reliable_amqp._compat.aiormq import (
    ConfirmChannel,
    close_reason,
    connection_close_reply,
    drop_silent,
    frame_max,
    last_frame_time,
    negotiated_heartbeat,
    open_confirm_channel,
    translate_connection_error,
    wait_writable,
    watch_blocked,
    write_payload,
)
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import AmqpConnectionError, ReliableAmqpError
from reliable_amqp._core.supervisor import CLOSE_GRACE, GiveUp, Supervisor
from reliable_amqp._core.topology import Topology
from reliable_amqp._core.tracker import ATTEMPT_HEADER

E = TypeVar("E", bound="Entry[Any]")

log = logging.getLogger("reliable_amqp")


class Pump(Generic[E]):
    """Moves messages between a :class:`Supervisor` and the broker, and keeps a link up."""

    def __init__(
        self,
        supervisor: Supervisor[E],
        source: ConnectionSource,
        topology: Topology,
        *,
        resolve: Callable[[list[E]], None],
        on_end: Callable[[], None],
    ) -> None:
        self.supervisor = supervisor
        self.options = supervisor.options
        self.source = source
        self.topology = topology
        #: turns resolved entries into resolved futures (the publisher's)
        self.resolve = resolve
        self.on_end = on_end
        #: called once, before what is left is failed, when the task was cancelled while the
        #: publisher was open (its event loop is stopping under it: asyncio.run's end)
        self.on_abandoned: Callable[[], None] | None = None
        self._abandoned = False
        #: set once the first channel opened, or the publisher failed or closed
        self.ready = asyncio.Event()
        #: the connection the channel is on, while it is open (declarations use it)
        self.connection: aiormq.abc.AbstractConnection | None = None
        #: set while the channel is open
        self.opened = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._channel: ConfirmChannel | None = None
        #: the connection being served, for the liveness check, and why it was dropped (silent)
        self._watched: aiormq.abc.AbstractConnection | None = None
        self._silent: ReliableAmqpError | None = None
        #: admitted by publish(), not yet taken by the engine: taken in one call when the
        #: publishing task yields (:meth:`accept_pending`), not one engine call per message
        self._pending: list[E] = []
        self._accept_due = False  # an accept_pending is scheduled

    @property
    def fatal(self) -> ReliableAmqpError | None:
        """Why the publisher gave up for good (wrong credentials, connect policy spent)."""
        return self.supervisor.fatal

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called or the publisher gave up."""
        return self.supervisor.stopping

    @property
    def started(self) -> bool:
        """True once :meth:`start` ran."""
        return self._task is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the publisher runs on (the one :meth:`start` ran on)."""
        assert self._loop is not None, "not started"
        return self._loop

    def start(self) -> None:
        """Start the connection task on the running loop."""
        loop = self._loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._task = loop.create_task(self._run(), name="reliable-amqp-connection")

    # --- the hand-over from publish() -----------------------------------------------------------

    def take(self, entry: E) -> Callable[[], None] | None:
        """The admission's hand-over of one admitted entry (its future set): it joins the run
        the engine takes when the publishing task next yields (:meth:`accept_pending`). Returns
        the wake-up to make (scheduling that), None when one is scheduled already."""
        self._pending.append(entry)
        return None if self._accept_due else self._accept_soon

    def take_run(self, entries: Sequence[E]) -> Callable[[], None]:
        """The admission's hand-over of a run (``publish_many()``, a spool's read back): to the
        engine at once, after what :meth:`take` holds (publish order is send order)."""
        self.accept_pending()
        self.supervisor.accept(entries, time.monotonic())
        return self.wake

    @property
    def pending(self) -> list[E]:
        """What :meth:`take` holds (replaced, not emptied, when the engine takes it)."""
        return self._pending

    def holds(self, entry: E) -> bool:
        """Whether ``entry`` is the latest message handed over (an interrupted admission asks:
        see ``_core.admission``)."""
        pending = self._pending
        return (bool(pending) and pending[-1] is entry) or self.supervisor.holds(entry)

    def _accept_soon(self) -> None:
        if not self._accept_due:
            self.loop.call_soon(self.accept_pending)
            self._accept_due = True

    def accept_pending(self) -> None:
        """Give the engine what :meth:`take` holds, in order, and wake the writer. Scheduled by
        the first :meth:`take` of a run; called before anything reads the engine's count of
        messages (stats, shutdown, a run handed over)."""
        self._accept_due = False
        pending = self._pending
        if not pending:
            return
        self._pending = []
        try:
            self.supervisor.accept(pending, time.monotonic())
        except BaseException:  # a KeyboardInterrupt: the run is whole in the engine or here
            if not self.supervisor.holds(pending[-1]):
                self._pending[:0] = pending
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
        if self._pending and not self._accept_due:
            self._accept_soon()  # the interrupt may have cut the take() that owed it

    def stop(self) -> None:
        """Ask the connection task to tear down (the caller has settled or will settle
        messages)."""
        self.supervisor.begin_close()
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)
        self.ready.set()

    async def join(self) -> None:
        """Wait until the connection task has closed the channel and its connection."""
        if self._task is not None:
            # shield: cancelling the waiter must not interrupt the close handshake half-way
            await asyncio.shield(self._task)

    # --- the timer -----------------------------------------------------------------------------

    def schedule(self) -> None:
        """Make sure the timer fires when the supervisor next has work."""
        due = self.supervisor.next_wakeup()
        timer = self._timer
        if due is None or self._loop is None or (timer is not None and timer.when() <= due):
            return
        if timer is not None:
            timer.cancel()
        # call_at takes the loop's clock; the supervisor's is time.monotonic (the same on every
        # platform asyncio supports, but convert the difference rather than assume it).
        loop = self._loop
        self._timer = loop.call_at(loop.time() + max(0.0, due - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        now = time.monotonic()
        watched = self._watched
        if watched is not None and self._silent is None and not watched.is_closed:
            silent = self.supervisor.check_liveness(last_frame_time(watched), now)
            if silent is not None:  # a frozen broker closes nothing: drop the link ourselves
                log.warning("reliable-amqp: %s", silent)
                self._silent = silent
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

    # --- tasks ---------------------------------------------------------------------------------

    async def _write(self, channel: ConfirmChannel) -> None:
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

    async def _run(self) -> None:
        try:
            await self._connect_loop()
        except asyncio.CancelledError:
            self._abandoned = not self.stopping
            raise
        except Exception as exc:
            # A bug must not leave callers waiting on futures nobody settles.
            log.exception("reliable-amqp: async publisher supervisor failed")
            self._give_up(ReliableAmqpError(f"internal error in the publisher: {exc!r}"))
        finally:
            await self._shutdown()

    async def _connect_loop(self) -> None:
        supervisor = self.supervisor
        source = self.source
        while not self.stopping:
            established = False
            reply = None
            try:
                connection = await source.obtain(supervisor.next_attempt(), self._stop_signal())
                if len(self.topology):
                    # A restarted broker lost non-durable topology: declare it again first.
                    await _topology.replay(connection, self.topology, self.options.connect_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                loss = translate_connection_error(exc)
            else:
                established = True
                loss = await self._serve(connection)
                reply = connection_close_reply(connection)
            resolved, plan = supervisor.connection_lost(
                loss, time.monotonic(), established=established, reply=reply
            )
            self.resolve(resolved)
            if plan is None:
                return
            if isinstance(plan, GiveUp):
                self._gave_up()
                return
            await self._sleep(plan.delay)

    async def _serve(self, connection: aiormq.abc.AbstractConnection) -> ReliableAmqpError:
        """Open channels on ``connection`` until it is lost; returns the loss."""
        # The supervisor's liveness check (two heartbeats of silence) runs ahead of aiormq's own
        # watchdog (three heartbeats and three seconds).
        self._silent = None
        unusable = self.supervisor.connection_opened(
            frame_max(connection),
            negotiated_heartbeat(connection),
            last_frame_time(connection),
            time.monotonic(),
            connection.server_properties,  # which broker: its own limits (_core.brokers)
        )
        if unusable is not None:
            return unusable
        self._watched = connection
        self.schedule()
        unwatch = watch_blocked(connection, self._on_blocked)
        try:
            loss = await self._serve_channels(connection)
            return self._silent or loss
        finally:
            self._watched = None
            if unwatch is not None:
                unwatch()

    def _on_blocked(self, blocked: bool, reason: str) -> None:
        if blocked:
            self.supervisor.blocked(reason)
        elif self.supervisor.unblocked():
            self._wakeup.set()

    async def _serve_channels(self, connection: aiormq.abc.AbstractConnection) -> ReliableAmqpError:
        supervisor = self.supervisor
        while not self.stopping:
            if connection.is_closed:
                return AmqpConnectionError("connection lost")
            try:
                channel = await open_confirm_channel(
                    connection, self, supervisor.generation, self.options.connect_timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if connection.is_closed or self.stopping:
                    return translate_connection_error(exc)
                log.warning("reliable-amqp: could not open a channel: %r", exc)
                await self._sleep(supervisor.channel_failed())
                continue
            if not supervisor.channel_opened():  # closing meanwhile: leave it unused
                await _close_quietly(channel)
                break
            self._channel = channel
            self.connection = connection
            self.ready.set()
            self.opened.set()
            await self._write_while_open(channel)
            self.opened.clear()
            self._channel = None
            self.connection = None
            if self.stopping:
                if self.source.borrowed:  # an owned connection's close ends its channels too
                    await _close_quietly(channel)
                break
            code, text = close_reason(channel)
            if connection.is_closed or self._silent is not None:  # the connection's loss
                return AmqpConnectionError(f"connection lost: {text}")
            resolved, delay = supervisor.channel_closed(code, text, time.monotonic())
            self.resolve(resolved)
            await self._sleep(delay)
        return AmqpConnectionError("publisher closed")

    async def _write_while_open(self, channel: ConfirmChannel) -> None:
        """Run the writer for ``channel`` until the channel closes or the publisher stops."""
        writer = asyncio.get_running_loop().create_task(
            self._write(channel), name="reliable-amqp-writer"
        )
        closing = channel.closing
        try:
            await asyncio.wait(
                {closing, writer, self._stop_signal()}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            writer.cancel()
            if not closing.done():
                closing.cancel()  # only the observer: the channel itself stays as it is
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            # A bug in the writer: frames may be half written, so this channel cannot go on.
            log.error("reliable-amqp: writer failed", exc_info=writer.exception())
            await _close_quietly(channel)

    def _stop_signal(self) -> asyncio.Future[None]:
        assert self._stop is not None
        return self._stop

    async def _sleep(self, delay: float) -> None:
        if delay > 0 and not self.stopping:
            await asyncio.wait({self._stop_signal()}, timeout=delay)

    def _give_up(self, error: ReliableAmqpError) -> None:
        self.supervisor.give_up(error)
        self._gave_up()

    def _gave_up(self) -> None:
        self.ready.set()
        self.on_end()

    async def _shutdown(self) -> None:
        supervisor = self.supervisor
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.on_end()  # no more publishes: release those waiting for room
        if self._abandoned and self.on_abandoned is not None:
            self.on_abandoned()
        self.accept_pending()  # settled with the rest
        self.resolve(supervisor.shutdown())
        self.ready.set()
        channel, self._channel = self._channel, None
        try:
            if channel is not None:
                await _close_quietly(channel)
            await self.source.release()
        finally:
            supervisor.closed()


async def _close_quietly(channel: ConfirmChannel) -> None:
    if not loop_is_running():  # finalized after the loop closed: no close can run (see there)
        return
    try:
        await asyncio.wait_for(channel.close(), CLOSE_GRACE)
    except Exception as exc:  # best effort, a timeout included: the broker may be gone
        log.debug("reliable-amqp: closing the channel failed: %r", exc)
