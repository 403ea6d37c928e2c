"""Publisher: streaming publisher confirms over pika, for threads.

pika objects are not thread-safe, so one I/O thread owns the connection (a ``SelectConnection``)
and the :class:`PublishEngine`. ``publish()`` validates the message on the caller's thread, takes
room in the in-flight window, appends to an outbox and wakes the I/O thread only when it is idle;
the I/O thread writes messages in batches and settles confirms as they arrive. Nothing here
decides what a frame means: the engine does, and this module turns its resolutions into futures.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from types import TracebackType
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel
from pika.spec import Basic, BasicProperties
from sortedcontainers import SortedList

from reliable_amqp._core.engine import PublishEngine, Resolution, is_permanent_channel_close
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    AuthenticationFailed,
    ConfigurationError,
    InvalidMessage,
    MessageRejected,
    OperationTimeout,
    PublisherClosed,
    PublishTimeout,
    RecoveryFailed,
    ReliableAmqpError,
    broker_error,
)
from reliable_amqp._core.message import Confirmation, OutgoingMessage, build_message
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State, StateMachine
from reliable_amqp._core.stats import EventKind, PublisherEvent, Stats
from reliable_amqp._core.topology import Topology, TopologyOp, bind_op, exchange_op, queue_op
from reliable_amqp._core.tracker import ATTEMPT_HEADER
from reliable_amqp._sync.topology import Request, apply_topology

log = logging.getLogger("reliable_amqp")

_TICK = 0.05  # deadline and retry resolution on the I/O thread
_DRAIN_BATCH = 2000  # publishes per I/O-loop turn, so confirms are read between batches
_CLOSE_GRACE = 2.0  # seconds to wait for the broker's close-ok


class _CoalescingConnection(SelectConnection):  # type: ignore[misc]
    """A SelectConnection that can gather the frames of many publishes into one write.

    pika hands every frame to the socket separately (three ``send()`` calls per message); while
    :attr:`gather` is set, frames collect here and go out as one buffer on :meth:`emit_gathered`.
    ``_adapter_emit_data`` is pika's designated override point for where frames go.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.gather = False
        self._gathered: list[bytes] = []
        super().__init__(*args, **kwargs)

    def _adapter_emit_data(self, data: bytes) -> None:
        if self.gather:
            self._gathered.append(data)
        else:
            super()._adapter_emit_data(data)

    def emit_gathered(self) -> None:
        self.gather = False
        if self._gathered:
            data = b"".join(self._gathered)
            self._gathered.clear()
            super()._adapter_emit_data(data)


class _Handle:
    """What the engine holds per message: the caller's future and its flush index."""

    __slots__ = ("future", "index")

    def __init__(self, future: Future[Confirmation], index: int) -> None:
        self.future = future
        self.index = index


class Publisher:
    """A confirming publisher over pika; share one between threads.

    ``Publisher(url, **options)`` takes a broker URL (or a list of URLs to fail over between) and
    the options of :class:`~reliable_amqp.PublisherOptions`. Use it as a context manager, or call
    :meth:`connect` and :meth:`close`.
    """

    def __init__(self, url: str | Sequence[str], **options: Any) -> None:
        self.options = PublisherOptions.create(url, **options)
        self._params = [self._connection_parameters(u) for u in self.options.urls]
        self._room = threading.Condition(threading.Lock())
        self._count = 0
        self._bytes = 0
        self._issued = 0
        self._unresolved: SortedList[int] = SortedList()
        self._outbox: deque[tuple[OutgoingMessage, _Handle]] = deque()
        self._wake_pending = False
        self._accepting = True
        self._topology_requests: deque[Request] = deque()
        self._fatal: ReliableAmqpError | None = None
        # I/O-thread state below
        self._engine: PublishEngine[_Handle] = PublishEngine(
            delivery_timeout=self.options.delivery_timeout,
            nack_policy=self.options.nack_policy,
            dedup_header=self.options.dedup_header,
        )
        self._state = StateMachine()
        self._ioloop: Any = None
        self._connection: _CoalescingConnection | None = None
        self._channel: Channel | None = None
        self._loss: ReliableAmqpError | None = None
        self._round_opened = False
        self._channel_failures = 0
        self._topology = Topology()
        self._last_rx: tuple[int, float] = (-1, 0.0)  # bytes received, when that changed
        self._lost: tuple[str, float] | None = None  # what was lost ("connection"/"channel"), when
        self._ever_opened = False
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
        leftovers = list(self._outbox)
        self._outbox.clear()
        self._resolve(
            [
                Resolution(_bare_entry(m, h), PublisherClosed(m, 0, "publisher closed"))
                for m, h in leftovers
            ]
        )
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
        if message.properties.headers:
            _check_pika_encodable("headers", message.properties.headers)
        if not self._opened.is_set():
            self._check_accepting(message)
            self.connect()
        # Cancelling the future only means the caller stopped caring: the message stays tracked.
        future: Future[Confirmation] = Future()
        size = len(message.body)
        with self._room:
            if not self._fits(size):
                self._wait_for_room(size, message)
            self._check_accepting(message)
            self._count += 1
            self._bytes += size
            self._issued += 1
            handle = _Handle(future, self._issued)
            self._unresolved.add(self._issued)
            self._outbox.append((message, handle))
            wake = not self._wake_pending and self._ioloop is not None
            if wake:
                self._wake_pending = True
                loop = self._ioloop
        if wake:
            _call_threadsafe(loop, self._drain)
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
            mark = self._issued
            while self._unresolved and self._unresolved[0] <= mark:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._room.wait(remaining)
            return int(self._unresolved.bisect_right(mark))

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
            _call_threadsafe(loop, self._drain)

    # --- settling (any thread that holds the engine: the I/O thread) -------------------------

    def _resolve(self, resolutions: list[Resolution[_Handle]]) -> None:
        if not resolutions:
            return
        for r in resolutions:
            future = r.entry.handle.future
            try:
                if isinstance(r.result, Confirmation):
                    future.set_result(r.result)
                else:
                    future.set_exception(r.result)
            except InvalidStateError:
                pass  # the caller cancelled it; the message was still settled
        with self._room:
            for r in resolutions:
                self._count -= 1
                self._bytes -= r.entry.size
                self._unresolved.discard(r.entry.handle.index)
            self._room.notify_all()

    # --- the I/O thread ----------------------------------------------------------------------

    def _connection_parameters(self, url: str) -> pika.URLParameters:
        try:
            params = pika.URLParameters(url)
        except Exception as exc:  # pika raises ValueError, TypeError, KeyError on bad URLs
            raise ConfigurationError(
                f"malformed broker URL {redact_url(url)}: {type(exc).__name__}"
            ) from None
        if "heartbeat" not in url:
            params.heartbeat = self.options.heartbeat
        params.connection_attempts = 1
        params.retry_delay = 0
        params.socket_timeout = self.options.connect_timeout
        params.stack_timeout = self.options.connect_timeout
        params.blocked_connection_timeout = self.options.blocked_timeout
        params.client_properties = {
            "connection_name": self.options.connection_name or "reliable-amqp",
            "product": "reliable-amqp",
        }
        return params

    def _run(self) -> None:
        self._io_ident = threading.get_ident()
        try:
            self._connect_loop()
        except BaseException as exc:
            # A bug must not leave callers publishing into an outbox nobody reads.
            log.exception("reliable-amqp: I/O thread failed")
            self._fail(ReliableAmqpError(f"internal error in the I/O thread: {exc!r}"), 0)
        finally:
            self._shutdown()

    def _connect_loop(self) -> None:
        failures = 0
        first_failure = 0.0
        attempt = 0
        while not self._stopping.is_set():
            params = self._params[attempt % len(self._params)]
            attempt += 1
            self._loss = None
            self._round_opened = False
            connection = _CoalescingConnection(
                params,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_open_error,
                on_close_callback=self._on_connection_closed,
            )
            self._connection = connection
            with self._room:
                self._ioloop = connection.ioloop
                self._wake_pending = False
            connection.ioloop.call_later(_TICK, self._on_tick)
            try:
                connection.ioloop.start()
            except Exception as exc:
                # pika lets some socket errors escape its loop (a peer reset right after
                # connect: "getpeername() failed"); that is a lost connection, not a crash.
                log.warning("reliable-amqp: I/O loop failed: %r", exc, exc_info=True)
                if self._loss is None:
                    self._loss = AmqpConnectionError(f"I/O loop failed: {exc!r}")
                    self._mark_lost("connection", EventKind.CONNECTION_LOST, str(self._loss))
            with self._room:
                self._ioloop = None
            connection.ioloop.close()  # each connection has its own loop: free its fds
            self._connection = None
            self._channel = None
            # Whatever was on the wire goes out again on the next connection, in order.
            self._resolve(self._engine.on_channel_lost(None, "connection lost", time.monotonic()))
            if self._stopping.is_set():
                break
            loss = self._loss or AmqpConnectionError("connection lost")
            if self._round_opened:
                failures = 0
            if failures == 0:
                first_failure = time.monotonic()
            failures += 1
            self._state.transition(State.RECOVERING)
            policy = self.options.connect_policy
            if not loss.retriable or not policy.allows(failures, time.monotonic() - first_failure):
                self._fail(loss, failures)
                return
            delay = (
                policy.delay(failures)
                if len(self._params) == 1 or (failures % len(self._params) == 0)
                else 0.0
            )
            log.warning(
                "reliable-amqp: connection to %s lost (%s); retry %d in %.2f s",
                redact_url(self.options.urls[(attempt - 1) % len(self._params)]),
                loss,
                failures,
                delay,
            )
            self._sleep(delay)

    def _sleep(self, delay: float) -> None:
        # Deadlines keep running while no connection is up: tick the engine while waiting.
        end = time.monotonic() + delay
        while not self._stopping.is_set():
            now = time.monotonic()
            self._accept_outbox(now)
            self._resolve(self._engine.tick(now))
            if now >= end:
                return
            self._stopping.wait(min(_TICK, end - now))

    def _fail(self, error: ReliableAmqpError, failures: int) -> None:
        fatal = (
            error
            if not error.retriable
            else RecoveryFailed(f"gave up connecting after {failures} attempts: {error}")
        )
        if fatal is not error:
            fatal.__cause__ = error
        log.error("reliable-amqp: %s", fatal)
        self._emit(EventKind.RECOVERY_FAILED, str(fatal))
        with self._room:
            self._fatal = fatal
            self._room.notify_all()

    def _shutdown(self) -> None:
        with self._room:
            requests = list(self._topology_requests)
            self._topology_requests.clear()
        for op, future in requests:
            if future is not None and not future.done():
                future.set_exception(ReliableAmqpError(f"publisher closed before {op.describe()}"))
        self._accept_outbox(time.monotonic())
        reason = str(self._fatal) if self._fatal is not None else "publisher closed"
        resolutions = self._engine.close_all(reason)
        for r in resolutions:
            r.result.__cause__ = self._fatal  # e.g. AuthenticationFailed, RecoveryFailed
        self._resolve(resolutions)
        if self._state.state is not State.CLOSING:
            self._state.transition(State.CLOSING)
        self._state.transition(State.CLOSED)
        self._emit(EventKind.CLOSED, reason)

    def _accept_outbox(self, now: float) -> None:
        with self._room:
            if not self._outbox:
                return
            items = self._outbox
            self._outbox = deque()
        accept = self._engine.accept
        for message, handle in items:
            accept(message, handle, now)

    # pika callbacks (I/O thread) ---------------------------------------------------------

    def _on_connection_open(self, connection: SelectConnection) -> None:
        if self._stopping.is_set():
            connection.close()
            return
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        # Declare again what the user declared (a restarted broker lost non-durable topology)
        # before any message is written.
        apply_topology(
            connection,
            [(op, None) for op in self._topology],
            on_applied=lambda op: None,
            then=lambda: self._open_channel(connection),
        )

    def _open_channel(self, connection: SelectConnection) -> None:
        generation = self._engine.tracker.generation
        connection.channel(on_open_callback=functools.partial(self._on_channel_open, generation))

    def _on_channel_open(self, generation: int, channel: Channel) -> None:
        channel.add_on_close_callback(functools.partial(self._on_channel_closed, generation))
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(
            ack_nack_callback=functools.partial(self._on_confirm, generation),
            callback=lambda _frame: self._on_confirm_mode(generation, channel),
        )

    def _on_confirm_mode(self, generation: int, channel: Channel) -> None:
        if generation != self._engine.tracker.generation or self._stopping.is_set():
            return
        self._channel = channel
        self._round_opened = True
        self._state.transition(State.OPEN)
        if not self._ever_opened:
            self._ever_opened = True
            self._emit(EventKind.CONNECTED, "connected; confirm mode on")
        elif self._lost is not None:
            what, since = self._lost
            if what == "connection":
                self._engine.counters.recoveries += 1
            downtime = time.monotonic() - since
            self._emit(
                EventKind.RECOVERED,
                f"{what} recovered after {downtime:.3f} s",
                downtime,
            )
        self._lost = None
        self._opened.set()
        self._drain()

    def _on_channel_closed(self, generation: int, channel: Channel, reason: Exception) -> None:
        stale = generation != self._engine.tracker.generation
        if stale or (self._channel is not None and self._channel is not channel):
            return
        self._channel = None
        connection = self._connection
        if connection is None or not connection.is_open or self._stopping.is_set():
            return  # the connection callback recovers
        code = getattr(reason, "reply_code", None)
        text = getattr(reason, "reply_text", str(reason))
        log.warning("reliable-amqp: channel closed: %s %s", code, text)
        self._mark_lost("channel", EventKind.CHANNEL_LOST, f"channel closed: {code} {text}")
        self._resolve(self._engine.on_channel_lost(code, text, time.monotonic()))
        if self._state.state is State.OPEN:
            self._state.transition(State.RECOVERING)
        if is_permanent_channel_close(code, text):
            self._open_channel(connection)  # the message that did it is out of the way
            return
        # A resource problem (LavinMQ's low disk, 506): back off before the next channel.
        self._channel_failures += 1
        delay = self.options.connect_policy.delay(self._channel_failures)
        connection.ioloop.call_later(delay, lambda: self._reopen_channel(connection))

    def _reopen_channel(self, connection: SelectConnection) -> None:
        current = self._connection
        if current is connection and current.is_open and self._channel is None:
            self._open_channel(current)

    def _on_connection_open_error(self, connection: SelectConnection, error: Any) -> None:
        self._loss = _translate_connection_error(error)
        connection.ioloop.stop()

    def _on_connection_closed(self, connection: SelectConnection, reason: Exception) -> None:
        if not self._stopping.is_set() and self._loss is None:
            self._loss = _translate_connection_error(reason)
            self._mark_lost("connection", EventKind.CONNECTION_LOST, str(self._loss))
        connection.ioloop.stop()

    def _mark_lost(self, what: str, kind: EventKind, detail: str) -> None:
        if self._lost is None or what == "connection":
            since = self._lost[1] if self._lost is not None else time.monotonic()
            self._lost = (what, since)
        self._emit(kind, detail)

    def _emit(self, kind: EventKind, detail: str, downtime: float | None = None) -> None:
        hook = self.options.on_event
        if hook is None:
            return
        try:
            hook(PublisherEvent(kind, detail, time.monotonic(), downtime))
        except Exception:
            log.exception("reliable-amqp: on_event hook raised (ignored)")

    def _on_blocked(self, connection: SelectConnection, frame: Any) -> None:
        log.warning("reliable-amqp: broker blocked the connection: %s", frame.method.reason)
        self._emit(EventKind.BLOCKED, str(frame.method.reason))
        if self._state.state is State.OPEN:
            self._state.transition(State.BLOCKED)

    def _on_unblocked(self, connection: SelectConnection, frame: Any) -> None:
        self._emit(EventKind.UNBLOCKED, "connection unblocked")
        if self._state.state is State.BLOCKED:
            self._state.transition(State.OPEN)
            self._drain()

    def _on_confirm(self, generation: int, frame: Any) -> None:
        method = frame.method
        now = time.monotonic()
        self._channel_failures = 0
        if isinstance(method, Basic.Ack):
            self._resolve(
                self._engine.on_ack(generation, method.delivery_tag, method.multiple, now)
            )
        else:
            self._resolve(
                self._engine.on_nack(generation, method.delivery_tag, method.multiple, now)
            )

    def _on_return(
        self, channel: Channel, method: Basic.Return, properties: BasicProperties, body: bytes
    ) -> None:
        attempt = (properties.headers or {}).get(ATTEMPT_HEADER)
        self._engine.on_return(attempt, method.reply_code, method.reply_text)

    def _on_tick(self) -> None:
        now = time.monotonic()
        self._check_liveness(now)
        self._accept_outbox(now)
        self._resolve(self._engine.tick(now))
        if self._stopping.is_set():
            self._begin_close()
            return
        if self._engine.has_sendable():
            self._drain()
        ioloop = self._ioloop
        if ioloop is not None:
            ioloop.call_later(_TICK, self._on_tick)

    def _check_liveness(self, now: float) -> None:
        """Notice a stalled link after 2 heartbeats of silence (pika alone waits 2x(hb+5) s)."""
        connection = self._connection
        heartbeat = self.options.heartbeat
        if connection is None or not heartbeat or not connection.is_open:
            self._last_rx = (-1, now)
            return
        received = connection.bytes_received
        if received != self._last_rx[0]:
            self._last_rx = (received, now)
            return
        silent = now - self._last_rx[1]
        if silent > 2 * heartbeat:
            self._loss = AmqpConnectionError(
                f"no data from the broker for {silent:.1f} s (heartbeat {heartbeat} s)"
            )
            self._mark_lost("connection", EventKind.CONNECTION_LOST, str(self._loss))
            self._last_rx = (-1, now)
            terminate = getattr(connection, "_terminate_stream", None)
            if terminate is not None:  # pika's own path for a dead stream: closes the socket
                terminate(self._loss)
            elif self._ioloop is not None:
                self._ioloop.stop()

    def _begin_close(self) -> None:
        if self._state.state is State.CLOSING:
            return
        self._state.transition(State.CLOSING)
        self._accept_outbox(time.monotonic())
        self._resolve(self._engine.close_all("publisher closed"))
        connection = self._connection
        ioloop = self._ioloop
        if connection is not None and not (connection.is_closing or connection.is_closed):
            try:
                connection.close()
                if ioloop is not None:
                    # A stalled broker never answers close-ok: do not wait for it forever.
                    ioloop.call_later(_CLOSE_GRACE, ioloop.stop)
                return
            except pika.exceptions.ConnectionWrongStateError:
                pass
        if ioloop is not None:
            ioloop.stop()

    def _drain(self) -> None:
        with self._room:
            self._wake_pending = False
        now = time.monotonic()
        self._accept_outbox(now)
        if self._stopping.is_set():
            if self._state.state is not State.CLOSING:
                self._begin_close()
            return
        self._apply_requested_topology()
        channel = self._channel
        if channel is None or not self._state.writable:
            return
        engine = self._engine
        publish = channel.basic_publish
        connection = self._connection
        assert connection is not None
        connection.gather = True
        try:
            for _ in range(_DRAIN_BATCH):
                entry = engine.next_to_send()
                if entry is None:
                    return
                message = entry.message
                headers = engine.mark_sent(entry)
                try:
                    publish(
                        message.exchange,
                        message.routing_key,
                        message.body,
                        _properties(message, headers),
                        message.mandatory,
                    )
                except (
                    pika.exceptions.UnsupportedAMQPFieldException,
                    struct.error,
                    TypeError,
                    ValueError,
                ) as exc:
                    # pika marshals every frame before writing any: nothing left, so the
                    # delivery tag is handed back and only this message fails.
                    if engine.tracker.untrack(entry):
                        self._resolve(
                            [
                                engine.fail(
                                    entry,
                                    MessageRejected(
                                        message, entry.attempts, 0, f"could not be encoded: {exc!r}"
                                    ),
                                )
                            ]
                        )
                        continue
                    self._abandon_channel(channel)
                    return
                except (pika.exceptions.AMQPError, OSError) as exc:
                    # The channel broke under us; whether the frame left is unknown, so the
                    # entry stays tracked and goes out again on a fresh channel.
                    log.warning("reliable-amqp: publish failed (%r); reopening the channel", exc)
                    self._abandon_channel(channel)
                    return
            ioloop = self._ioloop
            if ioloop is not None:
                ioloop.call_later(0, self._drain)  # let confirms in between batches
        finally:
            connection.emit_gathered()

    def _apply_requested_topology(self) -> None:
        connection = self._connection
        if not self._topology_requests or connection is None or not connection.is_open:
            return
        with self._room:
            requests = list(self._topology_requests)
            self._topology_requests.clear()
        apply_topology(connection, requests, on_applied=self._topology.record, then=lambda: None)

    def _abandon_channel(self, channel: Channel) -> None:
        self._channel = None
        self._resolve(self._engine.on_channel_lost(None, "publish failed", time.monotonic()))
        try:
            if channel.is_open:
                channel.close()
        except pika.exceptions.AMQPError:
            pass
        connection = self._connection
        if connection is not None and connection.is_open:
            self._open_channel(connection)


def _properties(message: OutgoingMessage, headers: Any) -> BasicProperties:
    p = message.properties
    return BasicProperties(
        content_type=p.content_type,
        content_encoding=p.content_encoding,
        headers=p.headers if headers is None else headers,
        delivery_mode=p.delivery_mode,
        priority=p.priority,
        correlation_id=p.correlation_id,
        reply_to=p.reply_to,
        expiration=p.expiration,
        message_id=p.message_id,
        timestamp=p.timestamp,
        type=p.type,
        user_id=p.user_id,
        app_id=p.app_id,
    )


def _check_pika_encodable(path: str, value: Any) -> None:
    """pika has no encoding for AMQP doubles: refuse float headers here, not in the I/O loop."""
    if isinstance(value, float):
        raise InvalidMessage(
            path,
            "the sync Publisher cannot send float header values (pika has no AMQP double "
            "encoding); send a Decimal or a str, or use AsyncPublisher",
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_pika_encodable(f"{path}[{key!r}]", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_pika_encodable(f"{path}[{i}]", item)


def _translate_connection_error(error: Any) -> ReliableAmqpError:
    """A pika connection failure as one of ours (credentials and vhosts are not retriable)."""
    if isinstance(error, ReliableAmqpError):
        return error
    if isinstance(
        error,
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError),
    ):
        result: ReliableAmqpError = AuthenticationFailed(
            "the broker refused the credentials (wrong user or password)"
        )
    elif isinstance(error, pika.exceptions.ProbableAccessDeniedError):
        result = AuthenticationFailed(
            "the broker refused access to the virtual host (missing vhost or no permission)"
        )
    elif isinstance(error, pika.exceptions.ConnectionClosed) and error.reply_code in (403, 530):
        broker = broker_error(error.reply_code, error.reply_text)
        result = AuthenticationFailed(f"the broker refused the connection: {broker}")
    else:
        result = AmqpConnectionError(f"{type(error).__name__}: {error!r}")
    if isinstance(error, BaseException):
        result.__cause__ = error
    return result


def _call_threadsafe(loop: Any, callback: Callable[[], None]) -> None:
    try:
        loop.add_callback_threadsafe(callback)
    except Exception:  # the loop closed under us; the next connection drains the outbox
        log.debug("reliable-amqp: wake-up lost with a closed I/O loop", exc_info=True)


def _bare_entry(message: OutgoingMessage, handle: _Handle) -> Any:
    from reliable_amqp._core.tracker import Entry

    return Entry(message=message, handle=handle, deadline=0.0, size=len(message.body))
