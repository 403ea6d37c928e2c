"""The async publisher's link: one task that keeps a connection and a confirm channel open.

Every decision is the core :class:`Supervisor`'s (which URL next and when, give up or not, what a
closed channel means); the link carries them out on aio-pika and aiormq: it obtains a
connection (its own, or a borrowed one), replays declared topology on a new connection, opens
the confirm channel, runs the :class:`~._pump.Pump`'s writer on it for as long as it is open,
and reports every loss. What travels over the channel is the pump's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import aiormq.abc

from reliable_amqp._async import _topology
from reliable_amqp._async._connect import ConnectionSource, loop_is_running
from reliable_amqp._async._pump import Pump
from reliable_amqp._compat.aiormq import (
    ConfirmChannel,
    close_reason,
    connection_close_reply,
    frame_max,
    last_frame_time,
    negotiated_heartbeat,
    open_confirm_channel,
    translate_connection_error,
    watch_blocked,
)
from reliable_amqp._compat.waits import cancel_requested, wait_for
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import AmqpConnectionError, ReliableAmqpError
from reliable_amqp._core.supervisor import CLOSE_GRACE, GiveUp, Supervisor
from reliable_amqp._core.topology import Topology

E = TypeVar("E", bound="Entry[Any]")

log = logging.getLogger("reliable_amqp")


class Link(Generic[E]):
    """Keeps a connection and a confirm channel up for a :class:`Pump`, until stopped."""

    def __init__(
        self,
        supervisor: Supervisor[E],
        source: ConnectionSource,
        topology: Topology,
        pump: Pump[E],
        *,
        on_end: Callable[[], None],
    ) -> None:
        self.supervisor = supervisor
        self.options = supervisor.options
        self.source = source
        self.topology = topology
        self.pump = pump
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._channel: ConfirmChannel | None = None

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
        loop = self._loop = self.pump.loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._task = loop.create_task(self._run(), name="reliable-amqp-connection")

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

    # --- the connection task -------------------------------------------------------------------

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
            connection = None
            loss: ReliableAmqpError
            try:
                connection = await source.obtain(supervisor.next_attempt(), self._stop_signal())
                if len(self.topology):
                    # A restarted broker lost non-durable topology: declare it again first.
                    await _topology.replay(connection, self.topology, self.options.connect_timeout)
            except asyncio.CancelledError:
                if not self._lost_not_cancelled(connection):
                    raise
                loss = AmqpConnectionError("connection lost while it was being set up")
            except Exception as exc:
                loss = translate_connection_error(exc)
            else:
                established = True
                loss = await self._serve(connection)
                reply = connection_close_reply(connection)
            resolved, plan = supervisor.connection_lost(
                loss, time.monotonic(), established=established, reply=reply
            )
            self.pump.resolve(resolved)
            if plan is None:
                return
            if isinstance(plan, GiveUp):
                self._gave_up()
                return
            await self._sleep(plan.delay)

    def _lost_not_cancelled(self, connection: aiormq.abc.AbstractConnection | None) -> bool:
        """Whether a CancelledError caught in the connection task is aiormq failing an RPC of a
        connection it closed (it does so with CancelledError), to be taken as a lost connection,
        rather than this task's own cancellation, which goes on up. Python 3.11+ tells
        (``Task.cancelling()``); where it cannot (3.10), only while closing. ``connection`` is
        None while it is being opened (then only Python's word counts)."""
        requested = cancel_requested()
        ours = requested if requested is not None else not self.stopping
        if ours:
            return False
        return connection is None or connection.is_closed or self.stopping

    async def _serve(self, connection: aiormq.abc.AbstractConnection) -> ReliableAmqpError:
        """Open channels on ``connection`` until it is lost; returns the loss."""
        # The supervisor's liveness check (two heartbeats of silence) runs ahead of aiormq's own
        # watchdog (three heartbeats and three seconds).
        pump = self.pump
        pump.silent = None
        unusable = self.supervisor.connection_opened(
            frame_max(connection),
            negotiated_heartbeat(connection),
            last_frame_time(connection),
            time.monotonic(),
            connection.server_properties,  # which broker: its own limits (_core.brokers)
        )
        if unusable is not None:
            return unusable
        pump.watched = connection
        pump.schedule()
        unwatch = watch_blocked(connection, pump.on_blocked)
        try:
            loss = await self._serve_channels(connection)
            return pump.silent or loss
        finally:
            pump.watched = None
            if unwatch is not None:
                unwatch()

    async def _serve_channels(self, connection: aiormq.abc.AbstractConnection) -> ReliableAmqpError:
        supervisor = self.supervisor
        while not self.stopping:
            if connection.is_closed:
                return AmqpConnectionError("connection lost")
            try:
                channel = await open_confirm_channel(
                    connection, self.pump, supervisor.generation, self.options.connect_timeout
                )
            except asyncio.CancelledError:
                if not self._lost_not_cancelled(connection):
                    raise
                return AmqpConnectionError("connection lost while a channel opened")
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
            if connection.is_closed or self.pump.silent is not None:  # the connection's loss
                return AmqpConnectionError(f"connection lost: {text}")
            resolved, delay = supervisor.channel_closed(code, text, time.monotonic())
            self.pump.resolve(resolved)
            await self._sleep(delay)
        return AmqpConnectionError("publisher closed")

    async def _write_while_open(self, channel: ConfirmChannel) -> None:
        """Run the writer for ``channel`` until the channel closes or the publisher stops."""
        writer = asyncio.get_running_loop().create_task(
            self.pump.write(channel), name="reliable-amqp-writer"
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
        self.pump.cancel_timer()
        self.on_end()  # no more publishes: release those waiting for room
        if self._abandoned and self.on_abandoned is not None:
            self.on_abandoned()
        self.pump.accept_pending()  # settled with the rest
        self.pump.resolve(supervisor.shutdown())
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
        await wait_for(channel.close(), CLOSE_GRACE)
    except Exception as exc:  # best effort, a timeout included: the broker may be gone
        log.debug("reliable-amqp: closing the channel failed: %r", exc)
