"""AsyncPublisher: streaming publisher confirms for asyncio, on aio-pika's connection.

The connection is aio-pika's (``aio_pika.connect``, or one the caller lends), but publishing goes
beneath aio-pika: the publisher opens its own confirm-mode channel on the underlying aiormq
connection, writes marshalled ``basic.publish`` frames in batches straight to that connection's
write queue, and reads acks, nacks and returns from the channel into the :class:`PublishEngine`.
aio-pika's per-message path (a ``Message``, a channel lock, a confirmation future and an awaited
socket drain per publish) is what limits its throughput; ``docs/async.md`` has the figures.

This module is the caller's side: validation, the in-flight window, futures and ``flush``. The
tasks that talk to the broker are in :mod:`._pump`. Everything runs on one event loop, so the
engine needs no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import aio_pika.abc

from reliable_amqp._async import _topology
from reliable_amqp._async._connect import ConnectionSource
from reliable_amqp._async._pump import Pump
from reliable_amqp._core.engine import PublishEngine, Resolution
from reliable_amqp._core.errors import (
    ConfigurationError,
    OperationTimeout,
    PublisherClosed,
    PublishTimeout,
    ReliableAmqpError,
)
from reliable_amqp._core.frames import encode_table
from reliable_amqp._core.message import Confirmation, OutgoingMessage, build_message
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.topology import Topology, TopologyOp, bind_op, exchange_op, queue_op


class _Handle:
    """What the engine holds per message: the caller's future and its flush index."""

    __slots__ = ("future", "index")

    def __init__(self, future: asyncio.Future[Confirmation], index: int) -> None:
        self.future = future
        self.index = index


class AsyncPublisher:
    """A confirming publisher for asyncio; share one between the tasks of one event loop.

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
            raise ConfigurationError("give AsyncPublisher a broker URL or a connection (one)")
        if connection is not None:
            # The options need a URL; the connection's own is the truthful one (for reprs).
            url = str(getattr(connection, "url", "") or "amqp://aio-pika-connection/")
        assert url is not None
        self.options = PublisherOptions.create(url, **options)
        self._engine: PublishEngine[_Handle] = PublishEngine(
            delivery_timeout=self.options.delivery_timeout,
            nack_policy=self.options.nack_policy,
            dedup_header=self.options.dedup_header,
        )
        self._topology = Topology()
        self._pump = Pump(
            self.options,
            self._engine,
            ConnectionSource(self.options, connection),
            self._topology,
            settle=self._resolve,
            on_end=self._release_room_waiters,
        )
        self._count = 0
        self._bytes = 0
        self._issued = 0
        self._unresolved: set[int] = set()
        self._low = 1  # no index below this is unresolved (advanced lazily, for flush)
        self._flushers: list[tuple[int, asyncio.Future[None]]] = []
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._accepting = True

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
        return f"<AsyncPublisher [{urls}] {self.state.value}, {self._count} in flight>"

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> AsyncPublisher:
        """Open the connection and channel (retrying under ``connect_policy``); raise if that fails.

        Called by ``async with`` and by the first ``publish()``. Wrong credentials raise
        :class:`AuthenticationFailed` at once; other failures raise :class:`RecoveryFailed` once
        the connect policy is spent.
        """
        pump = self._pump
        if not pump.started:
            if not self._accepting:
                raise ReliableAmqpError("publisher is closed")
            pump.start()
        await pump.ready.wait()
        if pump.fatal is not None:
            raise pump.fatal
        if not self._accepting:
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
        return self._pump.state.state

    def stats(self) -> Stats:
        """Counters (published, confirmed, nacked, returned, rejected, republished, timed out,
        ...), the in-flight gauge and a confirm-latency summary."""
        return self._engine.stats()

    @property
    def in_flight(self) -> int:
        """How many published messages are not resolved yet."""
        return self._count

    async def aclose(self, timeout: float | None = None) -> int:
        """Flush (up to ``timeout``, default ``close_timeout``), then close.

        Whatever is still unresolved then fails with :class:`PublisherClosed`: when ``aclose()``
        returns, every future this publisher handed out is resolved. Returns how many failed so.
        A lent aio-pika connection stays open; only the publisher's channel is closed.
        """
        self._accepting = False
        self._release_room_waiters()
        pump = self._pump
        if not pump.started:
            pump.ready.set()
            return 0
        left = 0
        try:
            if not pump.stopping:
                left = await self.flush(self.options.close_timeout if timeout is None else timeout)
        finally:
            # Even when aclose() itself is cancelled, nothing stays unresolved.
            self._resolve(self._engine.close_all("publisher closed"))
            pump.stop()
        await pump.join()
        return left

    # --- topology ----------------------------------------------------------------------------

    async def declare_exchange(
        self,
        exchange: str,
        exchange_type: str = "direct",
        *,
        durable: bool = True,
        auto_delete: bool = False,
        internal: bool = False,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Declare an exchange now, and again after every reconnect.

        Raises the broker's error (e.g. :class:`PreconditionFailed` for an exchange that exists
        with other settings) without disturbing messages in flight.
        """
        op = exchange_op(
            exchange,
            exchange_type,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )
        await self._declare(op, timeout)

    async def declare_queue(
        self,
        queue: str,
        *,
        durable: bool = True,
        exclusive: bool = False,
        auto_delete: bool = False,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> str:
        """Declare a queue now, and again after every reconnect; returns its name."""
        op = queue_op(
            queue,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=arguments,
        )
        await self._declare(op, timeout)
        return queue

    async def bind_queue(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        *,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Bind a queue to an exchange now, and again after every reconnect."""
        await self._declare(bind_op(queue, exchange, routing_key, arguments=arguments), timeout)

    async def _declare(self, op: TopologyOp, timeout: float | None) -> None:
        pump = self._pump
        if not pump.ready.is_set():
            await self.connect()
        self._check_usable()
        wait = self.options.connect_timeout if timeout is None else timeout
        try:  # while the publisher recovers, the declaration waits for the next channel
            await asyncio.wait_for(pump.opened.wait(), wait)
        except (asyncio.TimeoutError, TimeoutError):
            self._check_usable()  # closed or failed meanwhile: say that rather than "timeout"
            raise OperationTimeout(
                f"no connection to declare {op.describe()} within {wait:g} s"
            ) from None
        self._check_usable()
        connection = pump.connection
        assert connection is not None
        await _topology.declare(connection, op, wait)
        self._topology.record(op)

    def _check_usable(self) -> None:
        if self._pump.fatal is not None:
            raise self._pump.fatal
        if not self._accepting:
            raise ReliableAmqpError("publisher is closed")

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
        if message.properties.headers:
            # A table that cannot be encoded must fail here, not in the writer mid-batch.
            encode_table(message.properties.headers)
        if not self._pump.ready.is_set():
            await self.connect()
        self._check_accepting(message)
        size = len(message.body)
        if self._room_waiters or not self._fits(size):
            await self._wait_for_room(size, message)
        future: asyncio.Future[Confirmation] = self._pump.loop.create_future()
        self._issued += 1
        handle = _Handle(future, self._issued)
        self._unresolved.add(handle.index)
        self._count += 1
        self._bytes += size
        self._engine.accept(message, handle, time.monotonic())
        self._pump.wake()
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
        future = await self.publish(exchange, routing_key, body, mandatory=mandatory, **properties)
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
        fatal = self._pump.fatal
        if fatal is not None:
            raise PublisherClosed(message, 0, str(fatal)) from fatal
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


def _discard_outcome(future: asyncio.Future[Confirmation]) -> None:
    if not future.cancelled():
        future.exception()
