"""The sync publisher's I/O thread: the pika connection loop, its callbacks, writing, settling.

Everything here runs on the one thread that owns the pika connection and the PublishEngine; the
caller-facing half of :class:`~reliable_amqp.Publisher` lives in ``publisher.py``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import InvalidStateError
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel
from pika.spec import Basic, BasicProperties

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
from reliable_amqp._core.message import Confirmation, OutgoingMessage
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.state import State, StateMachine
from reliable_amqp._core.stats import EventKind
from reliable_amqp._core.topology import Topology
from reliable_amqp._core.tracker import ATTEMPT_HEADER
from reliable_amqp._sync._future import PublishFuture
from reliable_amqp._sync._pika import CoalescingConnection, translate_connection_error
from reliable_amqp._sync.topology import Request, apply_topology

log = logging.getLogger("reliable_amqp")

_TICK = 0.05  # deadline and retry resolution on the I/O thread
_DRAIN_BATCH = 2000  # publishes per I/O-loop turn, so confirms are read between batches
_CLOSE_GRACE = 2.0  # seconds to wait for the broker's close-ok


class IOThread:
    """The I/O-thread half of Publisher (a mixin: Publisher sets these attributes up)."""

    options: PublisherOptions
    _params: list[pika.URLParameters]
    _room: threading.Condition
    _count: int
    _bytes: int
    _barriers: list[list[int]]
    _outbox: deque[tuple[OutgoingMessage, PublishFuture]]
    _wake_pending: bool
    _topology_requests: deque[Request]
    _fatal: ReliableAmqpError | None
    _engine: PublishEngine[PublishFuture]
    _state: StateMachine
    _ioloop: Any
    _connection: CoalescingConnection | None
    _channel: Channel | None
    _loss: ReliableAmqpError | None
    _round_opened: bool
    _channel_failures: int
    _topology: Topology
    _last_rx: tuple[int, float]
    _events: Lifecycle
    _stopping: threading.Event
    _opened: threading.Event
    _io_ident: int | None

    # --- settling (any thread that holds the engine: the I/O thread) -------------------------

    def _resolve(self, resolutions: list[Resolution[PublishFuture]]) -> None:
        if not resolutions:
            return
        for r in resolutions:
            future = r.entry.handle
            try:
                if isinstance(r.result, Confirmation):
                    future.set_result(r.result)
                else:
                    future.set_exception(r.result)
            except InvalidStateError:
                pass  # the caller cancelled it; the message was still settled
        size = sum(r.entry.size for r in resolutions)
        with self._room:  # held briefly: publishing threads wait on this lock
            self._count -= len(resolutions)
            self._bytes -= size
            for barrier in self._barriers:
                mark = barrier[0]
                barrier[1] -= sum(1 for r in resolutions if r.entry.handle.index <= mark)
            self._room.notify_all()

    # --- the I/O thread ----------------------------------------------------------------------

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
            connection = CoalescingConnection(
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
                    self._events.lost("connection", EventKind.CONNECTION_LOST, str(self._loss))
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
        self._events.emit(EventKind.RECOVERY_FAILED, str(fatal))
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
            if isinstance(r.result, PublishError):
                r.result.__cause__ = self._fatal  # e.g. AuthenticationFailed, RecoveryFailed
        self._resolve(resolutions)
        if self._state.state is not State.CLOSING:
            self._state.transition(State.CLOSING)
        self._state.transition(State.CLOSED)
        self._events.emit(EventKind.CLOSED, reason)

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
        self._events.opened()
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
        self._events.lost("channel", EventKind.CHANNEL_LOST, f"channel closed: {code} {text}")
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
        self._loss = translate_connection_error(error)
        connection.ioloop.stop()

    def _on_connection_closed(self, connection: SelectConnection, reason: Exception) -> None:
        if not self._stopping.is_set() and self._loss is None:
            self._loss = translate_connection_error(reason)
            self._events.lost("connection", EventKind.CONNECTION_LOST, str(self._loss))
        connection.ioloop.stop()

    def _on_blocked(self, connection: SelectConnection, frame: Any) -> None:
        log.warning("reliable-amqp: broker blocked the connection: %s", frame.method.reason)
        self._events.emit(EventKind.BLOCKED, str(frame.method.reason))
        if self._state.state is State.OPEN:
            self._state.transition(State.BLOCKED)

    def _on_unblocked(self, connection: SelectConnection, frame: Any) -> None:
        self._events.emit(EventKind.UNBLOCKED, "connection unblocked")
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
            self._events.lost("connection", EventKind.CONNECTION_LOST, str(self._loss))
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
        connection = self._connection
        assert connection is not None
        # Frames are marshalled here, straight to bytes (pika's own path costs ~3x the CPU), and
        # gathered into one write per batch; pika still owns the socket and everything else.
        out = connection.begin_gather()
        number = channel.channel_number
        frame_max = connection.params.frame_max
        try:
            for _ in range(_DRAIN_BATCH):
                entry = engine.next_to_send()
                if entry is None:
                    return
                headers = engine.mark_sent(entry)
                mark = len(out)
                try:
                    publish_frames(number, entry.message, headers, frame_max, out)
                except InvalidMessage as exc:
                    # Drop what was gathered of this message: nothing of it is written, so its
                    # delivery tag is handed back and it fails alone.
                    del out[mark:]
                    engine.tracker.untrack(entry)
                    error = MessageRejected(
                        entry.message, entry.attempts, 0, f"could not be encoded: {exc}"
                    )
                    self._resolve([engine.fail(entry, error)])
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
