"""The async consumer's I/O, on the event loop itself: no thread between the socket and a handler.

pika's ``AsyncioConnection`` does what it does well on the running loop (connecting, TLS,
authentication, channels, ``basic.qos``, ``queue.declare``, ``basic.consume``, cancels and
closes); the deliveries are taken out of each socket read by
:class:`~reliable_amqp._core.delivery.DeliveryScanner` (:class:`LoopScanningConnection`), before
pika decodes the rest, and handed to the consumer in one batch per read, on the loop's thread;
acks are settled straight into :class:`~reliable_amqp._core.acks.AckBook` and leave as frames it
encodes (one write per batch). Nothing per message crosses a thread.

Recovery, the careful start, refusals and the connect policy are the sync consumer's
(:class:`~reliable_amqp._consume._io.ConsumerIO`), written for callbacks on the loop: a lost
connection is reconnected under the connect policy, a closed channel reopened, a ``basic.cancel``
answered with a new subscription; each channel is a new generation whose settlements never reach
another channel.

Heartbeats are pika's timers on the loop, so a handler that *awaits* for minutes costs nothing.
A handler that *blocks* the loop (``time.sleep``, a blocking driver) stops every timer: a
watchdog thread (:class:`_Watchdog`) notices that the loop has not run for half a heartbeat,
says so in one WARNING, and writes the heartbeat frames itself (plain TCP; on TLS it can only
warn: the broker then closes the connection after two missed heartbeats, and the consumer
reconnects once the loop runs again; the blocked message comes back, redelivered).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions
from pika.channel import Channel

from reliable_amqp._compat.pika import (
    LoopScanningConnection,
    scanner_takes_deliveries,
    terminate_stream,
)
from reliable_amqp._consume._io import REFUSED_ATTEMPTS, _gave_up, _refusal
from reliable_amqp._consume._lifecycle import node_of, product_of
from reliable_amqp._core.acks import ACK, AckBook, encode_ack_frames
from reliable_amqp._core.delivery import Delivery, DeliveryScanner
from reliable_amqp._core.errors import AmqpConnectionError, ReliableAmqpError
from reliable_amqp._core.liveness import LinkWatch
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._logs import own_context
from reliable_amqp._sync._pika import translate_connection_error

if TYPE_CHECKING:
    from reliable_amqp._consume._lifecycle import Lifecycle

log = logging.getLogger("reliable_amqp")


class LoopConsumerIO:
    """A consumer's connection on the running event loop (see the module's docstring).

    Built as :class:`~reliable_amqp._consume._io.ConsumerIO` is (a ``LinkFactory``); bound to
    its loop by :meth:`bind` before :meth:`start`. Deliveries reach ``on_deliveries`` on the
    loop's thread; :meth:`settle`, :meth:`flush` and :meth:`cancel` may be called from any thread
    (on the loop's they act at once), :meth:`drain` and :meth:`stop` from any thread but the
    loop's (they wait for it).
    """

    def __init__(
        self,
        params: list[pika.URLParameters],
        queue: str,
        *,
        prefetch: int,
        connect_policy: RetryPolicy,
        on_deliveries: Callable[[list[Delivery]], None],
        declare: dict[str, Any] | None = None,
        consumer_arguments: dict[str, Any] | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self._params = params
        self.queue = queue
        self.prefetch = prefetch
        self._batch = max(1, prefetch // 10)
        self._policy = connect_policy
        self._on_deliveries = on_deliveries
        self._declare = declare
        self._consumer_arguments = consumer_arguments or {}
        self._lifecycle = lifecycle
        self.loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        #: called on the loop when the I/O ends for good (the consumer wakes its workers)
        self.on_end: Callable[[], None] = _nothing
        self.stopping = threading.Event()
        self.consuming = threading.Event()
        self.ended = threading.Event()
        self.ended.set()
        self.fatal: ReliableAmqpError | None = None
        self.node: str | None = None
        self.server_properties: Mapping[str, Any] | None = None
        self.last_delivery: float | None = None
        self.recoveries = 0
        self.stale_settlements = 0
        self.generation = 0
        self.live_generation = 0
        # settlements from other threads: (generation, tag, kind)
        self._settled: deque[tuple[int, int, int]] = deque()
        self._wake_pending = False
        self._force = False
        self._connection: LoopScanningConnection | None = None
        self._closed: asyncio.Future[None] | None = None
        self._sleep: asyncio.Future[None] | None = None
        self._channel: Channel | None = None
        self._consumer_tag: str | None = None
        self._book: AckBook | None = None
        self._loss: ReliableAmqpError | None = None
        self._failures = 0
        self._first_failure: float | None = None
        self._cancelled = self._careful = self._draining = False
        self._drained = threading.Event()
        self._step = ""
        self._subscribed_once = False
        self._refused = 0
        self._last_loss: str | None = None
        self._watchdog: _Watchdog | None = None

    @property
    def connected(self) -> bool:
        """Whether the connection is open (a snapshot, any thread)."""
        connection = self._connection
        return connection is not None and bool(connection.is_open)

    @property
    def unacked(self) -> int:
        """Deliveries held on the open channel, not yet acked or requeued (a snapshot)."""
        book = self._book
        return 0 if book is None else book.held

    def is_live(self, generation: int) -> bool:
        """Whether ``generation`` is the open channel's (see :class:`ConsumerLink`)."""
        return generation == self.live_generation

    # --- any thread ---------------------------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop this I/O runs on (called on that loop's thread, before :meth:`start`)."""
        self.loop = loop
        self._loop_thread = threading.get_ident()

    def start(self) -> None:
        """Start consuming on the bound loop (again, after a run that ended)."""
        loop = self.loop
        if loop is None:
            raise ReliableAmqpError("the consumer's I/O is not bound to an event loop")
        if not self.ended.is_set():
            raise ReliableAmqpError("the consumer's I/O is still running")
        self.stopping.clear()
        self.ended.clear()
        self._drained.clear()
        self.consuming.clear()
        self.fatal = None
        self._settled.clear()
        self._force = self._draining = self._cancelled = False
        self._failures, self._first_failure = 0, None
        self._subscribed_once, self._refused, self._last_loss = False, 0, None
        self.last_delivery = None
        self._watchdog = _Watchdog(self)
        self._call(lambda: loop.create_task(self._run()))

    def settle(self, generation: int, tag: int, kind: int = ACK, urgent: bool = False) -> None:
        """A delivery is finished (``ACK``) or goes back to the queue (``REQUEUE``).

        On the loop's thread it goes straight into the ack book (a frame leaves once a batch is
        due); from another thread (a confirmed republish) it is handed over, and ``urgent`` has
        it sent at once.
        """
        if threading.get_ident() == self._loop_thread:
            book = self._book
            if book is None or not book.settle(generation, tag, kind):
                self.stale_settlements += 1
            elif urgent or book.due >= book.batch:
                self._force = self._force or urgent
                self._send_acks()
            return
        self._settled.append((generation, tag, kind))
        if urgent:
            self._force = True
            self._wake()
        elif len(self._settled) >= self._batch:
            self._wake()

    def flush(self) -> None:
        """Send every ack that is due now (the handler side is idle)."""
        book = self._book
        if self._settled or (book is not None and book.due):
            self._force = True
            if threading.get_ident() == self._loop_thread:
                self._send_acks()
            else:
                self._wake()

    def cancel(self) -> None:
        """Stop new deliveries (``basic.cancel``); settlements still go out."""
        self._call(self._on_cancel_request)

    def drain(self, timeout: float) -> bool:
        """Cancel the subscription, ack what was settled, requeue the rest; True once the
        frames are out (called off the loop: it waits for the loop to do it)."""
        self._draining = True
        self._force = True
        if self._connection is None or self.ended.is_set():
            return True
        if not self._call(self._on_drain):
            return True
        return self._drained.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Close the connection and end the I/O (unacked deliveries go back to the queue)."""
        self.stopping.set()
        self._call(self._close)
        if threading.get_ident() != self._loop_thread:
            self.ended.wait(timeout)

    def _call(self, callback: Callable[[], object]) -> bool:
        """Run ``callback`` on the loop: at once on its thread, else as soon as it can."""
        loop = self.loop
        if loop is None:
            return False
        if threading.get_ident() == self._loop_thread:
            callback()
            return True
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: nothing runs there any more
            return False
        return True

    def _wake(self) -> None:
        if self._wake_pending:
            return
        self._wake_pending = True
        if not self._call(self._on_wake):
            self._wake_pending = False

    # --- the connection's life (a task on the loop) -------------------------------------------

    async def _run(self) -> None:
        own_context()
        watchdog = self._watchdog
        try:
            if watchdog is not None:
                watchdog.start()
            await self._connect_loop()
        except BaseException as exc:  # a bug (or a cancel) must not leave run() waiting forever
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("reliable-amqp: consumer I/O failed")
                self.fatal = ReliableAmqpError(f"internal error in the consumer's I/O: {exc!r}")
            connection = self._connection
            if connection is not None and connection.is_open:
                with contextlib.suppress(Exception):
                    connection.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.consuming.clear()
            self.ended.set()
            self._drained.set()
            if watchdog is not None:
                watchdog.stop()
            self.on_end()

    async def _connect_loop(self) -> None:
        loop = asyncio.get_running_loop()
        index = 0
        while not self.stopping.is_set():
            params = self._params[index % len(self._params)]
            index += 1
            self._loss = None
            closed = self._closed = loop.create_future()
            connection = LoopScanningConnection(
                params,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=loop,
            )
            connection.on_deliveries = self._deliver
            self._connection = connection
            await closed
            self._connection = None
            self.node = None
            self._lost_channel()
            if self.stopping.is_set() or self._draining:
                return
            if not await self._backoff(self._loss or ReliableAmqpError("the connection closed")):
                return

    async def _backoff(self, loss: ReliableAmqpError) -> bool:
        """Wait before the next connection; False (and ``fatal`` set) when the policy is spent."""
        allowed = self._count_failure(loss)
        if not loss.retriable or not allowed:
            self.fatal = loss if not loss.retriable else _gave_up(self.queue, self._failures, loss)
            return False
        delay = self._policy.delay(self._failures)
        log.warning(
            "reliable-amqp: consumer of %r lost its subscription (%s); trying again in %.1f s",
            self.queue,
            loss,
            delay,
        )
        sleep = self._sleep = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(sleep, delay)
        self._sleep = None
        return not self.stopping.is_set()

    def _count_failure(self, loss: ReliableAmqpError) -> bool:
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        self._failures += 1
        self._last_loss = str(loss)
        return self._policy.allows(self._failures, now - self._first_failure)

    def _recovered(self) -> None:
        lifecycle = self._lifecycle
        if lifecycle is not None and not self.consuming.is_set():
            first = self._first_failure
            lifecycle.subscribed(
                self.node or "?",
                self._last_loss if self._subscribed_once else None,
                self._failures,
                time.monotonic() - first if first is not None else 0.0,
                self.server_properties,
            )
        if self._failures:
            self.recoveries += 1
        self._failures = 0
        self._first_failure = None
        self._subscribed_once = True
        self._refused = 0

    def _end_connection(self) -> None:
        closed = self._closed
        if closed is not None and not closed.done():
            closed.set_result(None)

    # --- pika callbacks (the loop) --------------------------------------------------------------

    def _on_open_error(self, _connection: Any, error: Any) -> None:
        self._loss = translate_connection_error(error)
        self._end_connection()

    def _on_connection_closed(self, _connection: Any, reason: Any) -> None:
        if self._loss is None and not self.stopping.is_set():
            self._loss = translate_connection_error(reason)
        self._end_connection()

    def _on_connection_open(self, connection: LoopScanningConnection) -> None:
        if self.stopping.is_set():
            connection.close()
            return
        params = connection.params
        self.node = node_of(params.host, params.port)
        self.server_properties = connection.server_properties
        if self._lifecycle is not None:
            self._lifecycle.connected(self.node, product_of(self.server_properties))
        heartbeat = int(params.heartbeat or 0)  # the negotiated value
        if self._watchdog is not None:
            self._watchdog.watch(connection, heartbeat)
        self._watch_link(connection, heartbeat)
        self._open_channel()

    def _watch_link(self, connection: LoopScanningConnection, heartbeat: int) -> None:
        """Two heartbeats without a byte is a lost link (a frozen node closes nothing): the
        publishers' rule (:class:`~reliable_amqp._core.liveness.LinkWatch`), on a loop timer."""
        watch = LinkWatch()
        watch.reset(time.monotonic(), heartbeat)
        watch.check(connection.bytes_received, time.monotonic())
        loop = asyncio.get_running_loop()

        def check() -> None:
            if connection is not self._connection or not connection.is_open:
                return
            now = time.monotonic()
            loss = watch.check(connection.bytes_received, now)
            if loss is not None:
                self._loss = loss
                if not terminate_stream(connection, loss):
                    self._end_connection()
                return
            due = watch.check_at
            if due is not None:
                loop.call_later(max(0.0, due - now), check)

        due = watch.check_at
        if due is not None:
            loop.call_later(max(0.0, due - time.monotonic()), check)

    def _open_channel(self) -> None:
        connection = self._connection
        if connection is None or not connection.is_open or self.stopping.is_set():
            return
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: Channel) -> None:
        connection = self._connection
        assert connection is not None
        self.generation += 1
        self.live_generation = self.generation
        self._channel = channel
        self._cancelled = False
        self._book = AckBook(self.generation, self._batch)
        connection.scanner = DeliveryScanner(channel.channel_number, self.generation, self.queue)
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_cancel_callback(self._on_server_cancel)
        # The careful start (see ConsumerIO): one message at a time while the broker
        # redelivers; the first fresh delivery opens the full prefetch.
        self._careful = self.prefetch > 1
        channel.basic_qos(
            prefetch_count=1 if self._careful else self.prefetch, callback=self._on_qos
        )

    def _on_qos(self, _frame: Any) -> None:
        channel = self._channel
        if channel is None:
            return
        if self._declare is not None:
            self._step = "queue.declare"
            channel.queue_declare(self.queue, callback=self._on_declared, **self._declare)
        else:
            self._on_declared(None)

    def _on_declared(self, _frame: Any) -> None:
        channel = self._channel
        if channel is None or self._draining:
            return
        self._step = "basic.consume"
        self._consumer_tag = channel.basic_consume(
            self.queue,
            scanner_takes_deliveries,
            arguments=self._consumer_arguments or None,
            callback=self._on_consume_ok,
        )

    def _on_consume_ok(self, _frame: Any) -> None:
        self._step = ""
        self._recovered()
        self.consuming.set()
        if self._draining:
            self._on_drain()

    def _on_server_cancel(self, _frame: Any) -> None:
        # The queue was deleted or became unavailable: close the channel (its deliveries go back
        # to the queue) and subscribe again under the policy.
        if self._draining or self.stopping.is_set():
            return
        self._cancelled = True
        log.warning(
            "reliable-amqp: the broker cancelled the consumer of %r (queue deleted or "
            "unavailable); subscribing again",
            self.queue,
        )
        channel = self._channel
        if channel is not None and channel.is_open:
            channel.close()

    def _on_channel_closed(self, channel: Channel, reason: Any) -> None:
        if channel is not self._channel:
            return
        self._lost_channel()
        connection = self._connection
        if connection is None or not connection.is_open or self.stopping.is_set():
            return
        if self._draining:
            self._drained.set()
            connection.close()
            return
        refused = _refusal(reason, self._step, self.queue, connection.params)
        loss: ReliableAmqpError = refused or AmqpConnectionError(
            "the broker cancelled the subscription"
            if self._cancelled
            else f"the channel closed: {translate_connection_error(reason)}"
        )
        allowed = self._count_failure(loss)
        if refused is not None and not self._subscribed_once:
            self._refused += 1
            if self._refused >= REFUSED_ATTEMPTS:
                allowed = False
                loss = refused
        if not allowed:
            self.fatal = loss if loss is refused else _gave_up(self.queue, self._failures, loss)
            self.stopping.set()
            connection.close()
            return
        delay = self._policy.delay(self._failures)
        log.warning(
            "reliable-amqp: consumer of %r lost its channel (%s); subscribing again in %.1f s",
            self.queue,
            loss,
            delay,
        )
        asyncio.get_running_loop().call_later(delay, self._open_channel)

    def _lost_channel(self) -> None:
        connection = self._connection
        if connection is not None:
            connection.scanner = None
        self.consuming.clear()
        self.live_generation = 0
        self._channel = None
        self._book = None
        self._consumer_tag = None

    def _deliver(self, batch: list[Delivery]) -> None:
        self.last_delivery = time.monotonic()
        book = self._book
        if book is not None:
            book.delivered_all(batch)
        if self._careful and any(not d.redelivered for d in batch):
            self._leave_careful()
        self._on_deliveries(batch)

    def _leave_careful(self) -> None:
        """The redelivered messages are through: subscribe again with the full prefetch (see
        ConsumerIO._leave_careful: the cancel first, then a prefetch less what is held)."""
        self._careful = False
        channel = self._channel
        tag = self._consumer_tag
        if channel is None or not channel.is_open or tag is None or self._draining:
            return
        same: Channel = channel

        def current() -> bool:
            return bool(same.is_open) and same is self._channel and not self._draining

        def resubscribe(_frame: Any) -> None:
            if current():
                self._on_declared(None)

        def cancelled(_frame: Any) -> None:
            if current():
                book = self._book
                held = book.held if book is not None else 0
                same.basic_qos(prefetch_count=max(1, self.prefetch - held), callback=resubscribe)

        self._consumer_tag = None
        channel.basic_cancel(tag, callback=cancelled)

    def _on_wake(self) -> None:
        self._wake_pending = False
        self._send_acks()

    def _send_acks(self) -> None:
        book = self._book
        settled = self._settled
        force = self._force
        self._force = False
        while settled:
            generation, tag, kind = settled.popleft()
            if book is None or not book.settle(generation, tag, kind):
                self.stale_settlements += 1
        if book is None:
            return
        channel = self._channel
        connection = self._connection
        if channel is None or not channel.is_open or connection is None:
            return
        frames = book.take(force)
        if frames:
            connection.emit_frames(encode_ack_frames(channel.channel_number, frames))

    def _on_cancel_request(self) -> None:
        channel = self._channel
        if channel is not None and channel.is_open and self._consumer_tag is not None:
            channel.basic_cancel(self._consumer_tag)
            self._consumer_tag = None

    def _on_drain(self) -> None:
        self._on_cancel_request()
        self._force = True
        self._send_acks()
        book = self._book
        channel = self._channel
        connection = self._connection
        if book is not None and channel is not None and channel.is_open and connection:
            frames = book.requeue_rest()
            if frames:
                connection.emit_frames(encode_ack_frames(channel.channel_number, frames))
        self._drained.set()

    def _close(self) -> None:
        connection = self._connection
        if connection is not None and (connection.is_open or connection.is_opening):
            with contextlib.suppress(pika.exceptions.ConnectionWrongStateError):
                connection.close()
        else:
            self._end_connection()
        sleep = self._sleep
        if sleep is not None and not sleep.done():
            sleep.set_result(None)


def _nothing() -> None:
    """The default end callback."""


class _Watchdog:
    """Keeps a connection's heartbeats going while the event loop is blocked.

    The loop stamps :attr:`pulse` on a timer every quarter heartbeat; this thread looks as
    often. When the stamp is older than half a heartbeat, the loop is blocked (a handler's
    blocking call): it says so once per stall at WARNING and writes a heartbeat frame itself
    (:meth:`LoopScanningConnection.heartbeat_from_thread`); when the loop runs again, the loop
    says for how long it was blocked.
    """

    def __init__(self, io: LoopConsumerIO) -> None:
        self._io = io
        self._connection: LoopScanningConnection | None = None
        self._period = 0.0
        self.pulse = time.monotonic()
        self._stalled_since: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._watch, name="reliable-amqp-consume-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._connection = None

    def watch(self, connection: LoopScanningConnection, heartbeat: int) -> None:
        """A connection opened with ``heartbeat`` (0: none, nothing to keep alive)."""
        self._connection = connection if heartbeat else None
        self._period = heartbeat / 4
        if heartbeat:
            self._beat(connection)

    def _beat(self, connection: LoopScanningConnection) -> None:
        now = time.monotonic()
        if self._stalled_since is not None:
            log.warning(
                "reliable-amqp: the event loop of the consumer of %r ran again after %.1f s "
                "blocked",
                self._io.queue,
                now - self.pulse,
            )
            self._stalled_since = None
        self.pulse = now
        if connection is self._connection and connection.is_open and not self._done.is_set():
            asyncio.get_running_loop().call_later(self._period, self._beat, connection)

    def _watch(self) -> None:
        while not self._done.wait(self._period or 0.5):
            connection = self._connection
            period = self._period
            if connection is None or not period or not connection.is_open:
                continue
            stalled = time.monotonic() - self.pulse
            if stalled < 2 * period:  # half a heartbeat
                continue
            written = connection.heartbeat_from_thread()
            if self._stalled_since is None:
                self._stalled_since = self.pulse
                log.warning(
                    "reliable-amqp: the event loop of the consumer of %r has not run for %.1f s "
                    "(a blocking call in a handler?): deliveries, acks and the other handlers "
                    "wait for it; %s",
                    self._io.queue,
                    stalled,
                    "this consumer's watchdog thread sends the connection's heartbeats meanwhile"
                    if written
                    else "heartbeats cannot be sent from another thread on this connection "
                    "(TLS): the broker closes it after two missed heartbeats and the consumer "
                    "reconnects once the loop runs again",
                )
