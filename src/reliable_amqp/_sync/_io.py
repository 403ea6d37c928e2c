"""The sync publisher's I/O thread: moves bytes between pika and the supervisor, runs its timers.

Everything here runs on the one thread that owns the pika connection and the
:class:`~reliable_amqp._core.supervisor.Supervisor`. What a frame or a loss means, which URL to
try next and when, and when to wake up are the supervisor's decisions; this module only carries
them out on a pika ``SelectConnection`` and hands the resolved entries to the :class:`Handoff`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.channel import Channel
from pika.spec import Basic, BasicProperties

from reliable_amqp._compat.pika import CoalescingConnection, terminate_stream
from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.supervisor import CLOSE_GRACE, GiveUp, Supervisor
from reliable_amqp._core.topology import Topology
from reliable_amqp._core.tracker import ATTEMPT_HEADER
from reliable_amqp._logs import own_context, own_loop
from reliable_amqp._sync._future import PublishFuture
from reliable_amqp._sync._handoff import Flag, Handoff
from reliable_amqp._sync._pika import call_threadsafe, translate_connection_error
from reliable_amqp._sync._topology import apply_topology

log = logging.getLogger("reliable_amqp")


class IOThread:
    """The thread that owns one publisher's pika connection and its supervisor."""

    def __init__(
        self,
        params: list[pika.URLParameters],
        handoff: Handoff,
        supervisor: Supervisor[PublishFuture],
        topology: Topology,
    ) -> None:
        self._params = params
        self._handoff = handoff
        self._supervisor = supervisor
        self._topology = topology
        #: set by close() (a Ctrl-C-safe flag: see Flag)
        self.stopping = Flag()
        self.opened = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # I/O-thread state below
        self._connection: CoalescingConnection | None = None
        self._channel: Channel | None = None
        self._loss: ReliableAmqpError | None = None
        self._reply: tuple[int, str] | None = None  # the broker's connection.close, if any
        self._established = False
        self._timer: Any = None  # pika timeout handle of the next wake-up
        self._timer_due: float | None = None

    # --- the caller's side ------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (once)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="reliable-amqp-io", daemon=True
                )
                self._thread.start()

    @property
    def started(self) -> bool:
        """True once :meth:`start` ran."""
        return self._thread is not None

    def stop(self, wait: bool = True) -> None:
        """Ask the thread to close the connection and end; with ``wait``, until it has."""
        self.stopping.set()
        self._handoff.wake(force=True)
        if wait and self._thread is not None:
            self._thread.join()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end; True when it has (or never ran)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        self._handoff.io_ident = threading.get_ident()
        own_context()  # pika's records about this connection are ours to report (_logs)
        try:
            self._connect_loop()
        except BaseException as exc:
            # A bug must not leave callers publishing into an outbox nobody reads.
            log.exception("reliable-amqp: I/O thread failed")
            self._give_up(ReliableAmqpError(f"internal error in the I/O thread: {exc!r}"))
        finally:
            self._shutdown()

    def _connect_loop(self) -> None:
        supervisor = self._supervisor
        while not self.stopping.is_set():
            params = self._params[supervisor.next_attempt()]
            self._loss = None
            self._reply = None
            self._established = False
            connection = CoalescingConnection(
                params,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_open_error,
                on_close_callback=self._on_connection_closed,
            )
            self._connection = connection
            loop = connection.ioloop
            own_loop(loop)  # pika resolves the host on a thread of its own (_logs)
            with self._handoff.lock:
                self._handoff.wake_loop = functools.partial(call_threadsafe, loop, self._drain)
                self._handoff.wake_pending = False
            self._timer = self._timer_due = None
            self._schedule()
            try:
                loop.start()
            except Exception as exc:
                # pika lets some socket errors escape its loop (a peer reset right after
                # connect: "getpeername() failed"); that is a lost connection, not a crash,
                # reported (once) as such by the retry that follows: the detail at DEBUG.
                log.debug("reliable-amqp: I/O loop failed: %r", exc, exc_info=True)
                if self._loss is None:
                    self._loss = translate_connection_error(exc)
            with self._handoff.lock:
                self._handoff.wake_loop = None
            loop.close()  # each connection has its own loop: free its fds
            self._connection = None
            self._channel = None
            # Whatever was on the wire goes out again on the next connection, in order.
            resolved, plan = supervisor.connection_lost(
                self._loss, time.monotonic(), established=self._established, reply=self._reply
            )
            self._handoff.resolve(resolved)
            if plan is None:
                break
            if isinstance(plan, GiveUp):
                self._handoff.fail(plan.error)
                return
            self._wait(plan.delay)

    def _wait(self, delay: float) -> None:
        """Between connections: accept publishes and keep deadlines running for ``delay``."""
        end = time.monotonic() + delay
        idle = self._handoff.idle
        while not self.stopping.is_set():
            now = time.monotonic()
            self._accept_outbox(now)
            self._handoff.resolve(self._supervisor.tick(now))
            if now >= end:
                return
            due = self._supervisor.next_wakeup()
            until = end if due is None else min(end, due)
            idle.wait(until - now)

    def _give_up(self, error: ReliableAmqpError) -> None:
        self._handoff.fail(self._supervisor.give_up(error))

    def _shutdown(self) -> None:
        for op, future in self._handoff.pop_requests():
            if future is not None and not future.done():
                future.set_exception(ReliableAmqpError(f"publisher closed before {op.describe()}"))
        self._accept_outbox(time.monotonic())
        self._handoff.resolve_closing(self._supervisor.shutdown())
        self._supervisor.closed()

    def _accept_outbox(self, now: float) -> int:
        """Hand what callers published, then what waits on disk (as room allows), to the
        engine; returns how many came from disk."""
        handoff = self._handoff
        items = handoff.pop_outbox()
        if items is not None:
            self._supervisor.accept(items, now)
        read = 0
        if handoff.spooled is not None:  # then what waited on disk, in order, as room allows
            backlog = handoff.spooled.refill()
            read = len(backlog)
            if backlog:
                self._supervisor.accept(backlog, now)
            elif items is None:
                return 0
        elif items is None:
            return 0
        self._schedule()  # their deadlines may come before the timer set (for liveness, say)
        return read

    # --- timers -----------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Make sure a timer fires when the supervisor next has work."""
        due = self._supervisor.next_wakeup()
        if due is None or (self._timer_due is not None and self._timer_due <= due):
            return
        connection = self._connection
        if connection is None:
            return
        loop = connection.ioloop
        if self._timer is not None:
            loop.remove_timeout(self._timer)
        self._timer_due = due
        self._timer = loop.call_later(max(0.0, due - time.monotonic()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_due = None
        now = time.monotonic()
        connection = self._connection
        if connection is not None and connection.is_open and self._loss is None:
            loss = self._supervisor.check_liveness(connection.bytes_received, now)
            if loss is not None:
                self._lose(connection, loss)
                return
        self._accept_outbox(now)
        self._handoff.resolve(self._supervisor.tick(now))
        if self._supervisor.has_sendable():
            self._drain()
        self._schedule()

    def _lose(self, connection: CoalescingConnection, loss: ReliableAmqpError) -> None:
        self._loss = loss
        if not terminate_stream(connection, loss):  # pika's own path for a dead stream
            connection.ioloop.stop()

    # --- pika callbacks (I/O thread) --------------------------------------------------------

    def _on_connection_open(self, connection: SelectConnection) -> None:
        self._established = True
        if self.stopping.is_set():
            connection.close()
            return
        connection.add_on_connection_blocked_callback(self._on_blocked)
        connection.add_on_connection_unblocked_callback(self._on_unblocked)
        params = connection.params  # pika writes the negotiated values back here
        unusable = self._supervisor.connection_opened(
            params.frame_max or 0,
            params.heartbeat or 0,
            connection.bytes_received,
            time.monotonic(),
            connection.server_properties,  # which broker: its own limits (_core.brokers)
        )
        if unusable is not None:
            self._lose(connection, unusable)
            return
        self._schedule()
        # Declare again what the user declared (a restarted broker lost non-durable topology)
        # before any message is written.
        apply_topology(
            connection,
            [(op, None) for op in self._topology],
            on_applied=lambda op: None,
            then=lambda: self._open_channel(connection),
        )

    def _open_channel(self, connection: SelectConnection) -> None:
        current = self._connection
        if current is None or current is not connection or not current.is_open:
            return  # a stale reopen: that connection is gone
        generation = self._supervisor.generation
        current.channel(on_open_callback=functools.partial(self._on_channel_open, generation))

    def _on_channel_open(self, generation: int, channel: Channel) -> None:
        channel.add_on_close_callback(functools.partial(self._on_channel_closed, generation))
        channel.add_on_return_callback(functools.partial(self._on_return, generation))
        channel.confirm_delivery(
            ack_nack_callback=functools.partial(self._on_confirm, generation),
            callback=lambda _frame: self._on_confirm_mode(generation, channel),
        )

    def _on_confirm_mode(self, generation: int, channel: Channel) -> None:
        if generation != self._supervisor.generation or self.stopping.is_set():
            return
        if not self._supervisor.channel_opened():
            return  # closing: the connection's close ends this channel too
        self._channel = channel
        self.opened.set()
        self._drain()

    def _on_channel_closed(self, generation: int, channel: Channel, reason: Exception) -> None:
        stale = generation != self._supervisor.generation
        if stale or (self._channel is not None and self._channel is not channel):
            return
        self._channel = None
        connection = self._connection
        if connection is None or not connection.is_open or self.stopping.is_set():
            return  # the connection's loss recovers it
        code = getattr(reason, "reply_code", None)
        text = getattr(reason, "reply_text", str(reason))
        resolved, delay = self._supervisor.channel_closed(code, text, time.monotonic())
        self._handoff.resolve(resolved)
        connection.ioloop.call_later(delay, functools.partial(self._open_channel, connection))

    def _on_connection_open_error(self, connection: SelectConnection, error: Any) -> None:
        self._loss = translate_connection_error(error, connection.params)  # names the host
        connection.ioloop.stop()

    def _on_connection_closed(self, connection: SelectConnection, reason: Exception) -> None:
        if isinstance(reason, pika.exceptions.ConnectionClosedByBroker):
            self._reply = (reason.reply_code, reason.reply_text)
        if self._loss is None:
            self._loss = translate_connection_error(reason, connection.params)
        connection.ioloop.stop()

    def _on_blocked(self, connection: SelectConnection, frame: Any) -> None:
        self._supervisor.blocked(str(frame.method.reason))

    def _on_unblocked(self, connection: SelectConnection, frame: Any) -> None:
        if self._supervisor.unblocked():
            self._drain()

    def _on_confirm(self, generation: int, frame: Any) -> None:
        method = frame.method
        ack = isinstance(method, Basic.Ack)
        isolating = self._supervisor.isolating
        self._handoff.resolve(
            self._supervisor.on_confirm(
                generation, ack, method.delivery_tag, method.multiple, time.monotonic()
            )
        )
        if not ack:
            self._schedule()  # a nack retry may come due before anything else
        if isolating and self._supervisor.has_sendable():
            # Suspects of a frame error go one at a time: the next one now (or, the last one
            # settled, everything that waited behind them).
            self._drain()

    def _on_return(
        self,
        generation: int,
        channel: Channel,
        method: Basic.Return,
        properties: BasicProperties,
        body: bytes,
    ) -> None:
        attempt = (properties.headers or {}).get(ATTEMPT_HEADER)
        self._supervisor.on_return(
            attempt,
            method.reply_code,
            method.reply_text,
            returned=(
                properties.message_id,
                method.exchange,
                method.routing_key,
                body,
                properties.headers,
            ),
            generation=generation,
        )

    # --- writing and closing ----------------------------------------------------------------

    def _drain(self) -> None:
        now = time.monotonic()
        read = self._accept_outbox(now)
        if self.stopping.is_set():
            self._begin_close()
            return
        self._apply_requested_topology()
        channel = self._channel
        if channel is None or not self._supervisor.writable:
            return
        connection = self._connection
        assert connection is not None
        # Frames are marshalled by the core straight to bytes (pika's own path costs several
        # times the CPU: docs/benchmarks.md) and gathered into one write per batch; pika still
        # owns the socket.
        out = connection.begin_gather()
        try:
            count, failed = self._supervisor.write(channel.channel_number, out)
        finally:
            connection.emit_gathered()
        self._handoff.resolve(failed)
        if (count and self._supervisor.has_sendable()) or (
            read and self._handoff.window.free_slots() > 0
        ):
            # let confirms in between batches; a backlog is read back a chunk at a time until
            # the window is full (one chunk a wake-up would leave it part empty)
            connection.ioloop.call_later(0, self._drain)

    def _begin_close(self) -> None:
        supervisor = self._supervisor
        if supervisor.stopping:
            return
        self._handoff.resolve_closing(supervisor.shutdown())
        connection = self._connection
        if connection is None:
            return
        loop = connection.ioloop
        if not (connection.is_closing or connection.is_closed):
            try:
                connection.close()
                # A stalled broker never answers close-ok: do not wait for it forever.
                loop.call_later(CLOSE_GRACE, loop.stop)
                return
            except pika.exceptions.ConnectionWrongStateError:
                pass
        loop.stop()

    def _apply_requested_topology(self) -> None:
        connection = self._connection
        if not self._handoff.requests or connection is None or not connection.is_open:
            return
        requests = self._handoff.pop_requests()
        apply_topology(connection, requests, on_applied=self._topology.record, then=lambda: None)
