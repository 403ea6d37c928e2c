"""AsyncPublisher: streaming publisher confirms for asyncio, on aio-pika's connection.

The connection is aio-pika's (``aio_pika.connect``, or one the caller hands over), but publishing
goes beneath it: the publisher opens its own confirm-mode channel on the underlying aiormq
connection, writes marshalled ``basic.publish`` frames in batches straight to that connection's
write queue, and reads acks, nacks and returns from the channel into the :class:`PublishEngine`.
aio-pika's per-message path (a ``Message``, a channel lock, a confirmation future and an awaited
socket drain per publish) is what limits its throughput; ``docs/async.md`` has the figures.

Everything runs on the event loop, so the engine needs no lock: ``publish()`` accepts into it
directly and wakes the writer task; the channel's reader settles confirms; a ticker expires
deadlines and releases nack retries; a supervisor task connects, reopens channels and reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq.abc
from aiormq.abc import ChannelFrame

from reliable_amqp._async._channel import (
    ConfirmChannel,
    close_reason,
    open_confirm_channel,
    translate_connection_error,
)
from reliable_amqp._async._connect import ConnectionSource
from reliable_amqp._async._frames import publish_frames
from reliable_amqp._core.engine import PublishEngine, Resolution, is_permanent_channel_close
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    ConfigurationError,
    PublisherClosed,
    PublishTimeout,
    RecoveryFailed,
    ReliableAmqpError,
)
from reliable_amqp._core.message import Confirmation, OutgoingMessage, build_message
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State, StateMachine
from reliable_amqp._core.tracker import ATTEMPT_HEADER

log = logging.getLogger("reliable_amqp")

_TICK = 0.05  # deadline and nack-retry resolution
_BATCH = 2000  # publishes per write: confirms are read between batches
_BATCH_BYTES = 1 << 20  # a large body goes out in a write of its own
_QUEUE_POLL = 0.001  # aiormq's write queue is full only while other channels write a lot
_CLOSE_GRACE = 5.0  # seconds to close our channel and connection after the last confirm


class _Handle:
    """What the engine holds per message: the caller's future and its flush index."""

    __slots__ = ("future", "index")

    def __init__(self, future: asyncio.Future[Confirmation], index: int) -> None:
        self.future = future
        self.index = index


class AsyncPublisher:
    """A confirming publisher for asyncio; share one between tasks of one event loop.

    ``AsyncPublisher(url, **options)`` takes a broker URL (or a list to fail over between) and the
    options of :class:`~reliable_amqp.PublisherOptions`; ``AsyncPublisher(connection=conn)`` (or
    :meth:`from_connection`) publishes over an existing aio-pika connection instead, which the
    caller keeps owning. Use ``async with``, or call :meth:`connect` and :meth:`aclose`.
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        connection: aio_pika.abc.AbstractConnection | None = None,
        **options: Any,
    ) -> None:
        if (url is None) == (connection is None):
            raise ConfigurationError("give AsyncPublisher a broker URL or a connection, not both")
        if connection is not None:
            url = str(getattr(connection, "url", "") or "amqp://aio-pika-connection/")
        assert url is not None
        self.options = PublisherOptions.create(url, **options)
        self._source = ConnectionSource(self.options, connection)
        self._engine: PublishEngine[_Handle] = PublishEngine(
            delivery_timeout=self.options.delivery_timeout,
            nack_policy=self.options.nack_policy,
            dedup_header=self.options.dedup_header,
        )
        self._state = StateMachine()
        self._count = 0
        self._bytes = 0
        self._issued = 0
        self._unresolved: set[int] = set()
        self._low = 1  # no index below this is unresolved (advanced lazily, for flush)
        self._flushers: list[tuple[int, asyncio.Future[None]]] = []
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._accepting = True
        self._stopping = False
        self._fatal: ReliableAmqpError | None = None
        self._wakeup = asyncio.Event()
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._channel: ConfirmChannel | None = None
        self._channel_failures = 0

    @classmethod
    def from_connection(
        cls, connection: aio_pika.abc.AbstractConnection, **options: Any
    ) -> AsyncPublisher:
        """A publisher over an existing aio-pika connection (which it never closes).

        With a ``RobustConnection`` the publisher survives connection loss: it waits for aio-pika
        to reconnect, opens a new channel and republishes what was unconfirmed. A plain
        connection that is lost ends the publisher (pending messages fail with PublisherClosed).
        """
        return cls(connection=connection, **options)

    def __repr__(self) -> str:
        urls = ", ".join(redact_url(u) for u in self.options.urls)
        return f"<AsyncPublisher [{urls}] {self._state.state.value}, {self._count} in flight>"

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> AsyncPublisher:
        """Open the connection and channel (retrying under ``connect_policy``); raise if that fails.

        Called by ``async with`` and by the first ``publish()``. Wrong credentials raise
        :class:`AuthenticationFailed` at once; other failures raise :class:`RecoveryFailed` once
        the connect policy is spent.
        """
        if self._task is None:
            if not self._accepting:
                raise ReliableAmqpError("publisher is closed")
            loop = asyncio.get_running_loop()
            self._loop = loop
            self._stop = loop.create_future()
            self._task = loop.create_task(self._run(), name="reliable-amqp-supervisor")
            self._ticker = loop.create_task(self._tick_loop(), name="reliable-amqp-ticker")
        await self._ready.wait()
        if self._fatal is not None:
            raise self._fatal
        if self._state.state is not State.OPEN and not self._accepting:
            raise ReliableAmqpError("publisher was closed while connecting")
        return self

    async def __aenter__(self) -> AsyncPublisher:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def state(self) -> State:
        """The connection state (see :class:`~reliable_amqp.State`)."""
        return self._state.state

    @property
    def in_flight(self) -> int:
        """How many published messages are not resolved yet."""
        return self._count

    async def aclose(self, timeout: float | None = None) -> int:
        """Flush (up to ``timeout``, default ``close_timeout``), then close.

        Whatever is still unresolved then fails with :class:`PublisherClosed`: when ``aclose()``
        returns, every future this publisher handed out is resolved. Returns how many failed so.
        A borrowed aio-pika connection stays open; only the publisher's channel is closed.
        """
        self._accepting = False
        self._release_room_waiters()
        task = self._task
        if task is None:
            self._ready.set()
            return 0
        left = 0
        try:
            if not task.done():
                left = await self.flush(self.options.close_timeout if timeout is None else timeout)
        finally:
            # Even when aclose() itself is cancelled, nothing stays unresolved.
            self._begin_stop()
        # The supervisor closes the channel and the connection; shielded so that cancelling
        # aclose() does not interrupt the close handshake half-way.
        await asyncio.shield(task)
        return left

    # --- publishing --------------------------------------------------------------------------

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool = False,
        **properties: Any,
    ) -> asyncio.Future[Confirmation]:
        """Send a message; return its future once accepted (waits only while the window is full).

        The future's result is a :class:`Confirmation`, or it raises the :class:`PublishError`
        subclass that says what became of the message. Keyword properties are AMQP basic
        properties (``headers``, ``message_id``, ``content_type``, ``correlation_id``,
        ``expiration``, ``priority``, ...); ``delivery_mode`` defaults to 2 (persistent) and a
        ``message_id`` is generated when none is given. Raises :class:`InvalidMessage` for a
        message AMQP cannot carry and :class:`PublishTimeout` when no room frees up within
        ``publish_timeout``. Cancelling the returned future only means the caller stopped
        caring: the message stays tracked until the broker settles it.
        """
        message = build_message(
            exchange, routing_key, body, mandatory=mandatory, properties=properties
        )
        if not self._ready.is_set():
            await self.connect()
        self._check_accepting(message)
        size = len(message.body)
        if self._room_waiters or not self._fits(size):
            await self._wait_for_room(size, message)
        loop = self._loop
        assert loop is not None
        future: asyncio.Future[Confirmation] = loop.create_future()
        self._issued += 1
        handle = _Handle(future, self._issued)
        self._unresolved.add(handle.index)
        self._count += 1
        self._bytes += size
        self._engine.accept(message, handle, time.monotonic())
        if not self._wakeup.is_set():
            self._wakeup.set()
        return future

    async def publish_and_wait(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool = False,
        **properties: Any,
    ) -> Confirmation:
        """Publish one message and wait for its outcome (prefer ``publish`` + ``flush`` for many).

        Cancelling the awaiting task leaves the message tracked: it is still confirmed or failed,
        counted by ``flush()`` and settled by ``aclose()``; only the waiting stops.
        """
        future = await self.publish(
            exchange, routing_key, body, mandatory=mandatory, **properties
        )
        try:
            # shield: cancelling the caller must not cancel the future the engine resolves
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # Nobody will look at the outcome now; do not let asyncio log it as unretrieved.
            future.add_done_callback(_discard_outcome)
            raise

    async def flush(self, timeout: float | None = None) -> int:
        """Wait until every message published so far is resolved; return how many are not.

        Messages published by other tasks after this call started are not waited for.
        """
        mark = self._issued
        if self._pending_upto(mark):
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            entry = (mark, waiter)
            self._flushers.append(entry)
            try:
                await asyncio.wait({waiter}, timeout=timeout)
            finally:
                if entry in self._flushers:
                    self._flushers.remove(entry)
        return sum(1 for index in self._unresolved if index <= mark)

    def _fits(self, size: int) -> bool:
        options = self.options
        return self._count < options.max_in_flight and (
            self._bytes + size <= options.max_in_flight_bytes or self._count == 0
        )

    async def _wait_for_room(self, size: int, message: OutgoingMessage) -> None:
        # FIFO: a publish that finds others waiting queues behind them even if it would fit.
        loop = asyncio.get_running_loop()
        end = loop.time() + self.options.publish_timeout
        retry = False
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            if retry:
                self._room_waiters.appendleft(waiter)  # keep its turn
            else:
                self._room_waiters.append(waiter)
            try:
                await asyncio.wait({waiter}, timeout=max(0.0, end - loop.time()))
            except asyncio.CancelledError:
                if waiter.done():
                    self._wake_room()  # it was this task's turn: hand it on
                else:
                    self._room_waiters.remove(waiter)
                raise
            if not waiter.done():
                self._room_waiters.remove(waiter)
                raise PublishTimeout(
                    f"in-flight window full for {self.options.publish_timeout:g} s "
                    f"({self._count} messages, {self._bytes} bytes unconfirmed; "
                    f"max_in_flight={self.options.max_in_flight}, "
                    f"max_in_flight_bytes={self.options.max_in_flight_bytes})"
                )
            self._check_accepting(message)
            if self._fits(size):
                self._wake_room()  # more room may be left for the next in line
                return
            retry = True

    def _wake_room(self) -> None:
        free = self.options.max_in_flight - self._count
        waiters = self._room_waiters
        while waiters and free > 0:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    def _release_room_waiters(self) -> None:
        while self._room_waiters:
            waiter = self._room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _check_accepting(self, message: OutgoingMessage) -> None:
        if self._fatal is not None:
            raise PublisherClosed(message, 0, str(self._fatal)) from self._fatal
        if not self._accepting:
            raise PublisherClosed(message, 0, "publisher is closed")

    def _pending_upto(self, mark: int) -> bool:
        low, issued, unresolved = self._low, self._issued, self._unresolved
        while low <= issued and low not in unresolved:
            low += 1
        self._low = low
        return low <= mark

    # --- settling ----------------------------------------------------------------------------

    def _resolve(self, resolutions: list[Resolution[_Handle]]) -> None:
        if not resolutions:
            return
        unresolved = self._unresolved
        freed = 0
        for r in resolutions:
            handle = r.entry.handle
            future = handle.future
            if not future.done():  # done: the caller cancelled it; the message was settled
                if isinstance(r.result, Confirmation):
                    future.set_result(r.result)
                else:
                    future.set_exception(r.result)
            unresolved.discard(handle.index)
            freed += r.entry.size
        self._count -= len(resolutions)
        self._bytes -= freed
        if self._room_waiters:
            self._wake_room()
        if self._flushers:
            self._wake_flushers()

    def _wake_flushers(self) -> None:
        self._pending_upto(self._issued)
        for mark, waiter in list(self._flushers):
            if self._low > mark and not waiter.done():
                waiter.set_result(None)

    # FrameSink: called by the channel's reader task
    def on_confirm(self, generation: int, ack: bool, tag: int, multiple: bool) -> None:
        """``basic.ack``/``basic.nack`` from the channel of ``generation``."""
        self._channel_failures = 0
        now = time.monotonic()
        engine = self._engine
        if ack:
            self._resolve(engine.on_ack(generation, tag, multiple, now))
        else:
            self._resolve(engine.on_nack(generation, tag, multiple, now))

    def on_return(self, headers: Any, reply_code: int, text: str) -> None:
        """``basic.return``: the ack that follows settles the message as returned."""
        attempt = headers.get(ATTEMPT_HEADER) if isinstance(headers, dict) else None
        self._engine.on_return(attempt, reply_code, text)

    # --- tasks -------------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        engine = self._engine
        while True:
            await asyncio.sleep(_TICK)
            self._resolve(engine.tick(time.monotonic()))
            if engine.has_sendable() and not self._wakeup.is_set():
                self._wakeup.set()

    async def _write(self, channel: ConfirmChannel) -> None:
        """Write what the engine has to send, in batches, for as long as ``channel`` is open."""
        connection = channel.connection
        queue = connection.write_queue
        frame_max = int(connection.connection_tune.frame_max or 0)
        number = channel.number
        generation = channel.generation
        engine = self._engine
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
                publish_frames(number, entry.message, headers, frame_max, parts)
                count += 1
                size += entry.size
            if not parts:
                continue
            drained: asyncio.Future[None] = loop.create_future()
            queue.put_nowait(
                ChannelFrame(payload=b"".join(parts), should_close=False, drain_future=drained)
            )
            # Waiting for the socket to take the batch is the backpressure; meanwhile new
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
        source = self._source
        while not self._stopping:
            opened = False
            try:
                connection = await source.obtain(attempt, self._stop_signal())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                loss = translate_connection_error(exc)
            else:
                opened, loss = await self._serve(connection)
            if self._stopping:
                return
            if opened:
                failures = 0
            if failures == 0:
                first_failure = time.monotonic()
            failures += 1
            if self._state.state is not State.RECOVERING:
                self._state.transition(State.RECOVERING)
            policy = self.options.connect_policy
            if not loss.retriable or not policy.allows(failures, time.monotonic() - first_failure):
                self._fail(loss, failures)
                return
            urls = len(self.options.urls)
            delay = policy.delay(failures) if urls == 1 or failures % urls == 0 else 0.0
            if source.borrowed:
                delay = 0.0  # the owner's connection does its own reconnecting; obtain() waits
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
        while not self._stopping:
            if connection.is_closed:
                return opened, AmqpConnectionError("connection lost")
            try:
                channel = await open_confirm_channel(
                    connection, self, self._engine.tracker.generation, self.options.connect_timeout
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if connection.is_closed or self._stopping:
                    return opened, translate_connection_error(exc)
                self._channel_failures += 1
                log.warning("reliable-amqp: could not open a channel: %r", exc)
                await self._sleep(self.options.connect_policy.delay(self._channel_failures))
                continue
            opened = True
            self._channel = channel
            self._state.transition(State.OPEN)
            self._ready.set()
            writer = asyncio.get_running_loop().create_task(
                self._write(channel), name="reliable-amqp-writer"
            )
            closing = channel.closing
            try:
                await asyncio.wait({closing, writer, self._stop_signal()},
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                writer.cancel()
                if not closing.done():
                    closing.cancel()  # only the observer; the channel stays as it is
            if writer.done() and not writer.cancelled() and writer.exception() is not None:
                # The writer broke (a bug): the frames it was building may be half written.
                log.error("reliable-amqp: writer failed", exc_info=writer.exception())
                await _close_quietly(channel)
            if self._stopping:
                return opened, AmqpConnectionError("publisher closed")
            self._channel = None
            code, text = close_reason(channel)
            log.warning("reliable-amqp: channel closed: %s %s", code, text)
            self._resolve(self._engine.on_channel_lost(code, text, time.monotonic()))
            self._state.transition(State.RECOVERING)
            if connection.is_closed:
                return opened, AmqpConnectionError(f"connection lost: {text}")
            if is_permanent_channel_close(code, text):
                continue  # the message that did it is out of the way: reopen at once
            # A resource problem (LavinMQ's low disk, 506, 541): back off before the next one.
            self._channel_failures += 1
            await self._sleep(self.options.connect_policy.delay(self._channel_failures))
        return opened, AmqpConnectionError("publisher closed")

    def _stop_signal(self) -> asyncio.Future[None]:
        assert self._stop is not None
        return self._stop

    async def _sleep(self, delay: float) -> None:
        if delay > 0 and not self._stopping:
            await asyncio.wait({self._stop_signal()}, timeout=delay)

    def _fail(self, error: ReliableAmqpError, failures: int) -> None:
        fatal = error if not error.retriable else RecoveryFailed(
            f"gave up connecting after {failures} attempts: {error}"
        )
        if fatal is not error:
            fatal.__cause__ = error
        log.error("reliable-amqp: %s", fatal)
        self._fatal = fatal
        self._ready.set()
        self._release_room_waiters()

    def _begin_stop(self) -> None:
        """Stop accepting, fail what is unresolved, and tell the supervisor to tear down."""
        self._accepting = False
        self._stopping = True
        self._release_room_waiters()
        if self._state.state not in (State.CLOSING, State.CLOSED):
            self._state.transition(State.CLOSING)
        self._resolve(self._engine.close_all("publisher closed"))
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)
        self._ready.set()

    async def _shutdown(self) -> None:
        reason = str(self._fatal) if self._fatal is not None else "publisher closed"
        self._accepting = False
        self._stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
        self._release_room_waiters()
        self._resolve(self._engine.close_all(reason))
        if self._state.state not in (State.CLOSING, State.CLOSED):
            self._state.transition(State.CLOSING)
        self._ready.set()
        channel, self._channel = self._channel, None
        try:
            if channel is not None:
                await _close_quietly(channel)
            await self._source.release()
        finally:
            self._state.transition(State.CLOSED)


async def _close_quietly(channel: ConfirmChannel) -> None:
    try:
        await asyncio.wait_for(channel.close(), _CLOSE_GRACE)
    except Exception as exc:  # closing is best effort (a timeout included)
        log.debug("reliable-amqp: closing the channel failed: %r", exc)


def _discard_outcome(future: asyncio.Future[Confirmation]) -> None:
    if not future.cancelled():
        future.exception()
