"""Publisher: streaming publisher confirms over pika, for threads.

pika objects are not thread-safe, so one I/O thread owns the connection (a ``SelectConnection``)
and the :class:`PublishEngine`. ``publish()`` validates the message on the caller's thread, takes
room in the in-flight window, appends to an outbox and wakes the I/O thread only when it is idle;
the I/O thread writes messages in batches and settles confirms as they arrive. Nothing here
decides what a frame means: the engine does, and this module turns its resolutions into futures.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from pika.channel import Channel

from reliable_amqp._core.engine import PublishEngine
from reliable_amqp._core.errors import (
    OperationTimeout,
    PublisherClosed,
    PublishTimeout,
    ReliableAmqpError,
)
from reliable_amqp._core.lifecycle import Lifecycle
from reliable_amqp._core.message import Confirmation, OutgoingMessage, build_message
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State, StateMachine
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.topology import Topology, TopologyOp, bind_op, exchange_op, queue_op
from reliable_amqp._sync._future import PublishFuture
from reliable_amqp._sync._io import IOThread
from reliable_amqp._sync._pika import CoalescingConnection, call_threadsafe, connection_parameters
from reliable_amqp._sync.topology import Request


class Publisher(IOThread):
    """A confirming publisher over pika; share one between threads.

    ``Publisher(url, **options)`` takes a broker URL (or a list of URLs to fail over between) and
    the options of :class:`~reliable_amqp.PublisherOptions`. Use it as a context manager, or call
    :meth:`connect` and :meth:`close`.
    """

    def __init__(self, url: str | Sequence[str], **options: Any) -> None:
        self.options = PublisherOptions.create(url, **options)
        self._params = [connection_parameters(u, self.options) for u in self.options.urls]
        self._room_lock = threading.Lock()  # publish() takes it bare: cheaper than the Condition
        self._room = threading.Condition(self._room_lock)
        self._count = 0
        self._bytes = 0
        self._issued = 0
        # one [mark, still unresolved] per flush() under way: counts down as messages resolve
        self._barriers: list[list[int]] = []
        self._outbox: deque[tuple[OutgoingMessage, PublishFuture]] = deque()
        self._future_lock = threading.RLock()  # shared by this publisher's futures
        self._wake_pending = False
        self._accepting = True
        self._topology_requests: deque[Request] = deque()
        self._fatal: ReliableAmqpError | None = None
        # I/O-thread state below
        self._engine: PublishEngine[PublishFuture] = PublishEngine(
            delivery_timeout=self.options.delivery_timeout,
            nack_policy=self.options.nack_policy,
            dedup_header=self.options.dedup_header,
        )
        self._state = StateMachine()
        self._ioloop: Any = None
        self._connection: CoalescingConnection | None = None
        self._channel: Channel | None = None
        self._loss: ReliableAmqpError | None = None
        self._round_opened = False
        self._channel_failures = 0
        self._topology = Topology()
        self._last_rx: tuple[int, float] = (-1, 0.0)  # bytes received, when that changed
        self._events = Lifecycle(self.options.on_event, self._engine.counters)
        self._stopping = threading.Event()
        self._opened = threading.Event()
        self._thread: threading.Thread | None = None
        self._io_ident: int | None = None
        self._start_lock = threading.Lock()

    def __repr__(self) -> str:
        urls = ", ".join(redact_url(u) for u in self.options.urls)
        return f"<Publisher [{urls}] {self._state.state.value}, {self._count} in flight>"

    # --- lifecycle ---------------------------------------------------------------------------

    def connect(self) -> Publisher:
        """Open the connection (retrying under ``connect_policy``); raise if that fails.

        Called by ``with`` and by the first ``publish()``. Wrong credentials raise
        :class:`AuthenticationFailed` at once; other failures raise :class:`RecoveryFailed` once
        the connect policy is spent.
        """
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="reliable-amqp-io", daemon=True
                )
                self._thread.start()
        while not self._opened.wait(0.05):
            if self._fatal is not None:
                raise self._fatal
            if not self._accepting:
                raise ReliableAmqpError("publisher was closed while connecting")
        return self

    def __enter__(self) -> Publisher:
        return self.connect()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def state(self) -> State:
        """The connection state (see :class:`~reliable_amqp.State`)."""
        return self._state.state

    def close(self, timeout: float | None = None) -> int:
        """Flush (up to ``timeout``, default ``close_timeout``), then close.

        Whatever is still unresolved then fails with :class:`PublisherClosed`: after ``close()``
        returns, every future this publisher handed out is resolved. Returns how many failed so.
        """
        with self._room:
            self._accepting = False
            self._room.notify_all()
        if self._thread is None:
            return 0
        left = self.flush(self.options.close_timeout if timeout is None else timeout)
        self._stopping.set()
        self._wake(force=True)
        self._thread.join()
        # The I/O thread settled everything it held; a publish that raced close() may remain.
        # The thread is gone, so the engine is this thread's to finish.
        self._accept_outbox(time.monotonic())
        self._resolve(self._engine.close_all("publisher closed"))
        return left

    # --- topology ----------------------------------------------------------------------------

    def declare_exchange(
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
        self._declare(op, timeout)

    def declare_queue(
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
        self._declare(op, timeout)
        return queue

    def bind_queue(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "",
        *,
        arguments: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Bind a queue to an exchange now, and again after every reconnect."""
        self._declare(bind_op(queue, exchange, routing_key, arguments=arguments), timeout)

    def _declare(self, op: TopologyOp, timeout: float | None) -> Any:
        if not self._opened.is_set():
            self.connect()
        future: Future[Any] = Future()
        with self._room:
            if self._fatal is not None:
                raise self._fatal
            if not self._accepting:
                raise ReliableAmqpError("publisher is closed")
            self._topology_requests.append((op, future))
        self._wake(force=True)
        wait = self.options.connect_timeout if timeout is None else timeout
        try:
            return future.result(wait)
        except TimeoutError:
            raise OperationTimeout(f"declaring {op.describe()} took over {wait:g} s") from None

    # --- publishing --------------------------------------------------------------------------

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool = False,
        **properties: Any,
    ) -> Future[Confirmation]:
        """Send a message; return a future at once (it waits only while the window is full).

        The future's ``result()`` is a :class:`Confirmation`, or raises the
        :class:`PublishError` subclass that says what became of the message. Keyword
        properties are AMQP basic properties (``headers``, ``message_id``, ``content_type``,
        ``correlation_id``, ``expiration``, ``priority``, ...); ``delivery_mode`` defaults to 2
        (persistent) and a ``message_id`` is generated when none is given.
        """
        message = build_message(
            exchange, routing_key, body, mandatory=mandatory, properties=properties
        )
        if not self._opened.is_set():
            self._check_accepting(message)
            self.connect()
        # Cancelling the future only means the caller stopped caring: the message stays tracked.
        future = PublishFuture(self._future_lock, 0)
        size = len(message.body)
        with self._room_lock:
            if not self._fits(size):
                self._wait_for_room(size, message)
            self._check_accepting(message)
            self._count += 1
            self._bytes += size
            self._issued += 1
            future.index = self._issued
            self._outbox.append((message, future))
            wake = not self._wake_pending and self._ioloop is not None
            if wake:
                self._wake_pending = True
                loop = self._ioloop
        if wake:
            call_threadsafe(loop, self._drain)
        return future

    def publish_and_wait(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool = False,
        **properties: Any,
    ) -> Confirmation:
        """Publish one message and wait for its outcome (slow: prefer ``publish`` + ``flush``)."""
        return self.publish(exchange, routing_key, body, mandatory=mandatory, **properties).result()

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every message published so far is resolved; return how many are not.

        Messages published by other threads after this call started are not waited for.
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self._room:
            # Every unresolved message now was issued before this call: they are the ones.
            barrier = [self._issued, self._count]
            self._barriers.append(barrier)
            try:
                while barrier[1] > 0:
                    remaining = None if end is None else end - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._room.wait(remaining)
            finally:
                self._barriers.remove(barrier)
            return barrier[1]

    def stats(self) -> Stats:
        """Counters (published, confirmed, nacked, returned, rejected, republished, timed out,
        ...), the in-flight gauge and a confirm-latency summary."""
        return self._engine.stats()

    @property
    def in_flight(self) -> int:
        """How many published messages are not resolved yet."""
        return self._count

    def _fits(self, size: int) -> bool:
        options = self.options
        return self._count < options.max_in_flight and (
            self._bytes + size <= options.max_in_flight_bytes or self._count == 0
        )

    def _wait_for_room(self, size: int, message: OutgoingMessage) -> None:
        if threading.get_ident() == self._io_ident:
            # A future callback publishing into a full window would wait for confirms that only
            # this (the I/O) thread can read: fail instead of deadlocking.
            raise PublishTimeout(
                "in-flight window full and publish() was called from a future's callback "
                "(the I/O thread); publish from another thread"
            )
        end = time.monotonic() + self.options.publish_timeout
        while not self._fits(size):
            self._check_accepting(message)
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise PublishTimeout(
                    f"in-flight window full for {self.options.publish_timeout:g} s "
                    f"({self._count} messages, {self._bytes} bytes unconfirmed; "
                    f"max_in_flight={self.options.max_in_flight}, "
                    f"max_in_flight_bytes={self.options.max_in_flight_bytes})"
                )
            self._room.wait(remaining)

    def _check_accepting(self, message: OutgoingMessage) -> None:
        if self._fatal is not None:
            raise PublisherClosed(message, 0, str(self._fatal)) from self._fatal
        if not self._accepting:
            raise PublisherClosed(message, 0, "publisher is closed")

    def _wake(self, force: bool = False) -> None:
        with self._room:
            if self._wake_pending and not force:
                return
            self._wake_pending = True
            loop = self._ioloop
        if loop is not None:
            call_threadsafe(loop, self._drain)
