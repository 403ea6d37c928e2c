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
watchdog thread (:mod:`reliable_amqp._consume._aio_watchdog`) notices that the loop has not run
for half a heartbeat, says so in one WARNING, and writes the heartbeat frames itself (plain TCP;
on TLS it can only warn: the broker then closes the connection after two missed heartbeats, and
the consumer reconnects once the loop runs again; the blocked message comes back, redelivered).
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

from reliable_amqp._compat.pika import LoopScanningConnection, terminate_stream
from reliable_amqp._compat.waits import wait_for
from reliable_amqp._consume._aio_channel import Subscription
from reliable_amqp._consume._aio_watchdog import Watchdog
from reliable_amqp._consume._io import REFUSED_ATTEMPTS, _gave_up, _refusal
from reliable_amqp._consume._lifecycle import node_of, product_of
from reliable_amqp._core.acks import ACK, ack_batch
from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.errors import AmqpConnectionError, ReliableAmqpError
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
        self._batch = ack_batch(prefetch)
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
        #: the open channel's subscription (None while there is none)
        self._sub: Subscription | None = None
        self._loss: ReliableAmqpError | None = None
        self._failures = 0
        self._first_failure: float | None = None
        self._draining = False
        self._drained = threading.Event()
        self._subscribed_once = False
        self._refused = 0
        self._last_loss: str | None = None
        self._watchdog: Watchdog | None = None

    @property
    def connected(self) -> bool:
        """Whether the connection is open (a snapshot, any thread)."""
        connection = self._connection
        return connection is not None and bool(connection.is_open)

    @property
    def unacked(self) -> int:
        """Deliveries held on the open channel, not yet acked or requeued (a snapshot)."""
        sub = self._sub
        return 0 if sub is None else sub.book.held

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
        self._force = self._draining = False
        self._failures, self._first_failure = 0, None
        self._subscribed_once, self._refused, self._last_loss = False, 0, None
        self.last_delivery = None
        self._watchdog = Watchdog(self.queue)
        self._call(lambda: loop.create_task(self._run()))

    def settle(self, generation: int, tag: int, kind: int = ACK, urgent: bool = False) -> None:
        """A delivery is finished (``ACK``) or goes back to the queue (``REQUEUE``).

        On the loop's thread it goes straight into the ack book (a frame leaves once a batch is
        due); from another thread (a confirmed republish) it is handed over, and ``urgent`` has
        it sent at once.
        """
        if threading.get_ident() == self._loop_thread:
            sub = self._sub
            if sub is None or not sub.book.settle(generation, tag, kind):
                self.stale_settlements += 1
            elif urgent or sub.book.due >= sub.book.batch:
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
        sub = self._sub
        if self._settled or (sub is not None and sub.book.due):
            self._force = True
            if threading.get_ident() == self._loop_thread:
                self._send_acks()
            else:
                self._wake()

    def cancel(self) -> None:
        """Stop new deliveries (``basic.cancel``); settlements still go out."""
        self._call(self._cancel_subscription)

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
        if not self._call(self._send_acks):
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
                on_open_error_callback=self._on_connection_ended,
                on_close_callback=self._on_connection_ended,
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
            await wait_for(sleep, delay)
        self._sleep = None
        return not self.stopping.is_set()

    def _count_failure(self, loss: ReliableAmqpError) -> bool:
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        self._failures += 1
        self._last_loss = str(loss)
        return self._policy.allows(self._failures, now - self._first_failure)

    def _link_lost(self, connection: LoopScanningConnection, loss: ReliableAmqpError) -> None:
        """Two heartbeats without a byte (the watchdog's LinkWatch): end this connection."""
        if connection is not self._connection:
            return
        self._loss = loss
        if not terminate_stream(connection, loss):
            self._end_connection()

    def _end_connection(self) -> None:
        closed = self._closed
        if closed is not None and not closed.done():
            closed.set_result(None)

    # --- pika callbacks (the loop) --------------------------------------------------------------

    def _on_connection_ended(self, _connection: Any, error: Any) -> None:
        """pika's open-error and close callbacks: the connect loop goes on."""
        if self._loss is None and not self.stopping.is_set():
            self._loss = translate_connection_error(error)
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
            self._watchdog.watch(connection, heartbeat, self._link_lost)
        self._open_channel()

    def _open_channel(self) -> None:
        connection = self._connection
        if connection is None or not connection.is_open or self.stopping.is_set():
            return
        self.generation += 1
        sub = Subscription(
            connection,
            self.queue,
            self.prefetch,
            self.generation,
            declare=self._declare,
            consumer_arguments=self._consumer_arguments,
            on_ready=self._on_subscribed,
            on_closed=self._on_channel_closed,
        )
        sub.draining = self._draining
        self._sub = sub
        self.live_generation = sub.generation
        sub.open()

    def _on_subscribed(self, sub: Subscription) -> None:
        if sub is not self._sub:
            return
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
        self.consuming.set()
        if self._draining:
            self._on_drain()

    def _on_channel_closed(self, sub: Subscription, reason: Any) -> None:
        if sub is not self._sub:
            return
        self._lost_channel()
        connection = self._connection
        if connection is None or not connection.is_open or self.stopping.is_set():
            return
        if self._draining:
            self._drained.set()
            connection.close()
            return
        refused = _refusal(reason, sub.step, self.queue, connection.params)
        loss: ReliableAmqpError = refused or AmqpConnectionError(
            "the broker cancelled the subscription"
            if sub.cancelled
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
        self._sub = None

    def _deliver(self, batch: list[Delivery]) -> None:
        self.last_delivery = time.monotonic()
        sub = self._sub
        if sub is not None:
            sub.delivered(batch)
        self._on_deliveries(batch)

    def _send_acks(self) -> None:
        self._wake_pending = False
        sub = self._sub
        settled = self._settled
        force = self._force
        self._force = False
        while settled:
            generation, tag, kind = settled.popleft()
            if sub is None or not sub.book.settle(generation, tag, kind):
                self.stale_settlements += 1
        if sub is not None:
            sub.send_acks(force)

    def _cancel_subscription(self) -> None:
        if self._sub is not None:
            self._sub.cancel()

    def _on_drain(self) -> None:
        self._force = True
        self._send_acks()
        sub = self._sub
        if sub is not None:
            sub.drain()
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
