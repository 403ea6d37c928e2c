"""The async publisher's tasks: a supervisor that (re)connects, a writer and a ticker.

- The supervisor obtains a connection (its own, or a borrowed one), replays declared topology on
  a new connection, opens the confirm channel, and when the channel or connection is lost tells
  the engine (``on_channel_lost``: the unconfirmed go out again) and recovers under the connect
  policy.
- The writer marshals what the engine has to send and puts it on aiormq's write queue in
  batches, one batch per socket drain, so publishes that arrive meanwhile share the next write.
- The ticker expires deadlines and releases nack retries.

Confirms and returns arrive through :class:`ConfirmChannel`'s reader and are settled at once.
All of this runs on one event loop, so the engine is never touched concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import aiormq.abc
from aiormq.abc import ChannelFrame

from reliable_amqp._async import _topology
from reliable_amqp._async._channel import (
    ConfirmChannel,
    close_reason,
    open_confirm_channel,
    translate_connection_error,
)
from reliable_amqp._async._connect import ConnectionSource
from reliable_amqp._core.engine import PublishEngine, Resolution, is_permanent_channel_close
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    InvalidMessage,
    MessageRejected,
    PublishError,
    RecoveryFailed,
    ReliableAmqpError,
)
from reliable_amqp._core.frames import publish_frames
from reliable_amqp._core.lifecycle import Lifecycle
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.state import State, StateMachine
from reliable_amqp._core.stats import EventKind
from reliable_amqp._core.topology import Topology
from reliable_amqp._core.tracker import ATTEMPT_HEADER

H = TypeVar("H")

log = logging.getLogger("reliable_amqp")

_TICK = 0.05  # deadline and nack-retry resolution
_BATCH = 2000  # publishes per write: confirms are read between batches
_BATCH_BYTES = 1 << 20  # a large body goes out in a write of its own
_QUEUE_POLL = 0.001  # aiormq's write queue is full only while other channels write a lot
_CLOSE_GRACE = 5.0  # seconds to close our channel after the last confirm


class Pump(Generic[H]):
    """Moves messages between a :class:`PublishEngine` and the broker, and keeps a link up."""

    def __init__(
        self,
        options: PublisherOptions,
        engine: PublishEngine[H],
        source: ConnectionSource,
        topology: Topology,
        *,
        settle: Callable[[list[Resolution[H]]], None],
        on_end: Callable[[], None],
    ) -> None:
        self.options = options
        self.engine = engine
        self.source = source
        self.topology = topology
        self.settle = settle
        self.on_end = on_end
        self.state = StateMachine()
        #: set once the first channel opened, or the publisher failed or closed
        self.ready = asyncio.Event()
        #: why the publisher gave up for good (wrong credentials, connect policy spent)
        self.fatal: ReliableAmqpError | None = None
        #: the connection the channel is on, while it is open (declarations use it)
        self.connection: aiormq.abc.AbstractConnection | None = None
        #: set while the channel is open
        self.opened = asyncio.Event()
        self.stopping = False
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._channel: ConfirmChannel | None = None
        self._channel_failures = 0
        self._events = Lifecycle(self.options.on_event, self.engine.counters)

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
        """Start the tasks on the running loop."""
        loop = self._loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self._task = loop.create_task(self._run(), name="reliable-amqp-supervisor")
        self._ticker = loop.create_task(self._tick_loop(), name="reliable-amqp-ticker")

    def wake(self) -> None:
        """Tell the writer there is something to send."""
        if not self._wakeup.is_set():
            self._wakeup.set()

    def stop(self) -> None:
        """Ask the supervisor to tear down (the caller has settled or will settle messages)."""
        self.stopping = True
        if self.state.state not in (State.CLOSING, State.CLOSED):
            self.state.transition(State.CLOSING)
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)
        self.ready.set()

    async def join(self) -> None:
        """Wait until the supervisor has closed the channel and its connection."""
        if self._task is not None:
            # shield: cancelling the waiter must not interrupt the close handshake half-way
            await asyncio.shield(self._task)

    # --- FrameSink: called by the channel's reader task ----------------------------------------

    def on_confirm(self, generation: int, ack: bool, tag: int, multiple: bool) -> None:
        """``basic.ack``/``basic.nack`` from the channel of ``generation``."""
        self._channel_failures = 0
        now = time.monotonic()
        if ack:
            self.settle(self.engine.on_ack(generation, tag, multiple, now))
        else:
            self.settle(self.engine.on_nack(generation, tag, multiple, now))

    def on_return(self, headers: Any, reply_code: int, text: str) -> None:
        """``basic.return``: the ack that follows settles the message as returned."""
        attempt = headers.get(ATTEMPT_HEADER) if isinstance(headers, dict) else None
        self.engine.on_return(attempt, reply_code, text)

    # --- tasks ---------------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        engine = self.engine
        while True:
            await asyncio.sleep(_TICK)
            self.settle(engine.tick(time.monotonic()))
            if engine.has_sendable():
                self.wake()

    async def _write(self, channel: ConfirmChannel) -> None:
        """Write what the engine has to send, in batches, for as long as ``channel`` is open."""
        connection = channel.connection
        queue = connection.write_queue
        frame_max = int(connection.connection_tune.frame_max or 0)
        number = channel.number
        generation = channel.generation
        engine = self.engine
        wakeup = self._wakeup
        loop = asyncio.get_running_loop()
        while True:
            if not engine.has_sendable():
                wakeup.clear()
                await wakeup.wait()
                continue
            while queue.full():  # the queue is shared with heartbeats and other channels
                await asyncio.sleep(_QUEUE_POLL)
            # From this check to put_nowait nothing yields: every message marked sent below is
            # written to a channel that was open, so the tracker's seqs are the broker's tags.
            if not channel.writable or generation != engine.tracker.generation:
                return
            parts: list[bytes | memoryview] = []
            count = size = 0
            while count < _BATCH and size < _BATCH_BYTES:
                entry = engine.next_to_send()
                if entry is None:
                    break
                headers = engine.mark_sent(entry)
                try:
                    publish_frames(number, entry.message, headers, frame_max, parts)
                except (InvalidMessage, TypeError, ValueError, struct.error) as exc:
                    # Checked at publish(), so this is a gap in those checks. Nothing of it
                    # was appended: hand its delivery tag back and fail this message alone.
                    if not engine.tracker.untrack(entry):
                        raise
                    error = MessageRejected(
                        entry.message, entry.attempts, 0, f"could not be encoded: {exc!r}"
                    )
                    self.settle([engine.fail(entry, error)])
                    continue
                count += 1
                size += entry.size
            if not parts:
                continue
            drained: asyncio.Future[None] = loop.create_future()
            queue.put_nowait(
                ChannelFrame(payload=b"".join(parts), should_close=False, drain_future=drained)
            )
            # Waiting until the socket took the batch is the backpressure; meanwhile new
            # publishes gather into the next batch.
            await drained

    async def _run(self) -> None:
        try:
            await self._connect_loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A bug must not leave callers waiting on futures nobody settles.
            log.exception("reliable-amqp: async publisher supervisor failed")
            self._fail(ReliableAmqpError(f"internal error in the publisher: {exc!r}"), 0)
        finally:
            await self._shutdown()

    async def _connect_loop(self) -> None:
        failures = 0
        first_failure = 0.0
        attempt = 0
        source = self.source
        while not self.stopping:
            opened = False
            try:
                connection = await source.obtain(attempt, self._stop_signal())
                if len(self.topology):
                    # A restarted broker lost non-durable topology: declare it again first.
                    await _topology.replay(connection, self.topology, self.options.connect_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                loss = translate_connection_error(exc)
            else:
                opened, loss = await self._serve(connection)
                if not self.stopping:
                    self._events.lost("connection", EventKind.CONNECTION_LOST, str(loss))
            if self.stopping:
                return
            if opened:
                failures = 0
            if failures == 0:
                first_failure = time.monotonic()
            failures += 1
            if self.state.state is not State.RECOVERING:
                self.state.transition(State.RECOVERING)
            policy = self.options.connect_policy
            if not loss.retriable or not policy.allows(failures, time.monotonic() - first_failure):
                self._fail(loss, failures)
                return
            urls = len(self.options.urls)
            delay = policy.delay(failures) if urls == 1 or failures % urls == 0 else 0.0
            if source.borrowed:
                delay = 0.0  # the owner's connection reconnects by itself; obtain() waits for it
            log.warning(
                "reliable-amqp: connection to %s lost (%s); retry %d in %.2f s",
                source.describe(attempt),
                loss,
                failures,
                delay,
            )
            attempt += 1
            await self._sleep(delay)

    async def _serve(
        self, connection: aiormq.abc.AbstractConnection
    ) -> tuple[bool, ReliableAmqpError]:
        """Open channels on ``connection`` until it is lost; (whether one opened, the loss)."""
        opened = False
        while not self.stopping:
            if connection.is_closed:
                return opened, AmqpConnectionError("connection lost")
            try:
                channel = await open_confirm_channel(
                    connection, self, self.engine.tracker.generation, self.options.connect_timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if connection.is_closed or self.stopping:
                    return opened, translate_connection_error(exc)
                self._channel_failures += 1
                log.warning("reliable-amqp: could not open a channel: %r", exc)
                await self._sleep(self.options.connect_policy.delay(self._channel_failures))
                continue
            opened = True
            self._channel = channel
            self.connection = connection
            self.state.transition(State.OPEN)
            self._events.opened()
            self.ready.set()
            self.opened.set()
            await self._pump(channel)
            self.opened.clear()
            self._channel = None
            self.connection = None
            if self.stopping:
                if self.source.borrowed:  # an owned connection's close ends its channels too
                    await _close_quietly(channel)
                break
            code, text = close_reason(channel)
            log.warning("reliable-amqp: channel closed: %s %s", code, text)
            if not connection.is_closed:  # else the connection is lost: reported as that
                self._events.lost(
                    "channel", EventKind.CHANNEL_LOST, f"channel closed: {code} {text}"
                )
            self.settle(self.engine.on_channel_lost(code, text, time.monotonic()))
            self.state.transition(State.RECOVERING)
            if connection.is_closed:
                return opened, AmqpConnectionError(f"connection lost: {text}")
            if is_permanent_channel_close(code, text):
                continue  # the message that did it is out of the way: reopen at once
            # A resource problem (LavinMQ's low disk, 506, 541): back off before the next one.
            self._channel_failures += 1
            await self._sleep(self.options.connect_policy.delay(self._channel_failures))
        return opened, AmqpConnectionError("publisher closed")

    async def _pump(self, channel: ConfirmChannel) -> None:
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

    # --- events ------------------------------------------------------------------------------

    def emit(self, kind: EventKind, detail: str, downtime: float | None = None) -> None:
        """Call the ``on_event`` hook, if any; a hook that raises is logged, not propagated."""
        self._events.emit(kind, detail, downtime)

    def _stop_signal(self) -> asyncio.Future[None]:
        assert self._stop is not None
        return self._stop

    async def _sleep(self, delay: float) -> None:
        if delay > 0 and not self.stopping:
            await asyncio.wait({self._stop_signal()}, timeout=delay)

    def _fail(self, error: ReliableAmqpError, failures: int) -> None:
        fatal = error
        if error.retriable:
            fatal = RecoveryFailed(f"gave up connecting after {failures} attempts: {error}")
            fatal.__cause__ = error
        log.error("reliable-amqp: %s", fatal)
        self.emit(EventKind.RECOVERY_FAILED, str(fatal))
        self.fatal = fatal
        self.ready.set()
        self.on_end()

    async def _shutdown(self) -> None:
        reason = str(self.fatal) if self.fatal is not None else "publisher closed"
        self.stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
        self.on_end()  # no more publishes: release those waiting for room
        resolutions = self.engine.close_all(reason)
        for r in resolutions:
            if self.fatal is not None and isinstance(r.result, PublishError):
                r.result.__cause__ = self.fatal  # AuthenticationFailed, RecoveryFailed, ...
        self.settle(resolutions)
        if self.state.state not in (State.CLOSING, State.CLOSED):
            self.state.transition(State.CLOSING)
        self.ready.set()
        channel, self._channel = self._channel, None
        try:
            if channel is not None:
                await _close_quietly(channel)
            await self.source.release()
        finally:
            self.state.transition(State.CLOSED)
            self.emit(EventKind.CLOSED, reason)


async def _close_quietly(channel: ConfirmChannel) -> None:
    try:
        await asyncio.wait_for(channel.close(), _CLOSE_GRACE)
    except Exception as exc:  # best effort, a timeout included: the broker may be gone
        log.debug("reliable-amqp: closing the channel failed: %r", exc)
