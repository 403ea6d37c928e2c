"""The consumer's I/O thread: one pika connection, one consuming channel, kept alive.

Everything here runs on the thread that owns the pika connection. Deliveries are decoded from
the raw frames by :class:`~reliable_amqp._core.delivery.DeliveryScanner` (pika sees only the
other frames) and handed to the handler side in batches, one batch per read from the socket.
Acks come back as settlements (:meth:`ConsumerIO.settle`, any thread) and leave as the frames
:class:`~reliable_amqp._core.acks.AckBook` decides. The handlers never run here, so heartbeats
keep flowing while a handler takes minutes.

Recovery: a lost connection is reconnected under the connect policy, a closed channel (a
``consumer_timeout``, a 404 on a queue that is gone) is reopened under the same policy, and a
``basic.cancel`` from the broker (the queue was deleted, a quorum leader moved) closes the
channel and subscribes again once the queue exists. Each new channel is a new *generation*:
settlements for deliveries of an older one are dropped, never sent on the new channel (the
broker already gave those messages back to the queue).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions
from pika.channel import Channel

from reliable_amqp._compat.pika import (
    ScanningConnection,
    scanner_takes_deliveries,
    terminate_stream,
)
from reliable_amqp._consume._attempts import Attempts, gave_up
from reliable_amqp._consume._lifecycle import node_of, product_of
from reliable_amqp._consume._settle import Settlements
from reliable_amqp._core.acks import ACK, AckBook
from reliable_amqp._core.delivery import Delivery, DeliveryScanner
from reliable_amqp._core.errors import AmqpConnectionError, ReliableAmqpError
from reliable_amqp._core.liveness import LinkWatch
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._logs import own_context, own_loop
from reliable_amqp._sync._pika import call_threadsafe, refusal_at, translate_connection_error

if TYPE_CHECKING:
    from reliable_amqp._consume._lifecycle import Lifecycle

log = logging.getLogger("reliable_amqp")

#: a queue refused at the start of a run (404 missing, 405 exclusive, 403 a permission) ends
#: run() after this many subscriptions tried (about a second with the default connect
#: policy), not after the policy's 10 minutes: waiting longer for a queue nobody declares only
#: hides the mistake. A queue lost once consumed is waited for under the whole policy.
REFUSED_ATTEMPTS = 3


class ConsumerIO:
    """The thread that owns a consumer's pika connection (see the module's docstring)."""

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
        generations: Callable[[], int] | None = None,
        careful_start: bool = True,
        reconnect: bool = True,
    ) -> None:
        self._params = params
        self.queue = queue
        self.prefetch = prefetch
        self._policy = connect_policy
        self._on_deliveries = on_deliveries
        self._declare = declare
        self._consumer_arguments = consumer_arguments or {}
        self._lifecycle = lifecycle
        self._generations = generations
        # the careful start resubscribes (cancel, then consume again): not on a queue with
        # single active consumer, where a cancel hands the queue to another consumer (and
        # LavinMQ requeues what the cancelled one holds)
        self._careful_start = careful_start
        # False: once subscribed, a lost connection ends the thread (``ended`` set, no
        # ``fatal``) instead of connecting again: the owner decides when to subscribe anew
        # (a partition on LavinMQ: PartitionGroup waits until the broker let the old consumer go)
        self._reconnect = reconnect
        self.stopping = threading.Event()
        #: set when a subscription is live (cleared while recovering)
        self.consuming = threading.Event()
        #: the error that ended the thread for good (the policy was spent), if any
        self.fatal: ReliableAmqpError | None = None
        self.ended = threading.Event()
        self._thread: threading.Thread | None = None
        #: settlements from any thread, sent as ack frames on the I/O thread
        self.acks = Settlements(prefetch, lambda: self.acks.send(self._book, self._channel))
        #: lost subscriptions counted against the connect policy
        self.attempts = Attempts(connect_policy)
        # I/O thread state
        self._connection: ScanningConnection | None = None
        self._channel: Channel | None = None
        self._consumer_tag: str | None = None
        self._book: AckBook | None = None
        self.generation = 0
        #: the generation whose channel is open now (0 while there is none): deliveries of any
        #: other are stale (the broker requeued them when their channel died)
        self.live_generation = 0
        self._cancelled = False
        self._careful = False  # consuming one at a time until a fresh delivery (see below)
        self._draining = False  # stop(): cancel, ack what finishes, requeue the rest
        self._drained = threading.Event()
        #: ``host:port`` of the open connection (None while there is none)
        self.node: str | None = None
        #: the connected broker's ``connection.start`` properties (product, version)
        self.server_properties: Mapping[str, Any] | None = None
        #: monotonic time of the last socket read that brought deliveries
        self.last_delivery: float | None = None
        self._step = ""  # the set-up step under way (for a refusal's remedy)

    @property
    def connected(self) -> bool:
        """Whether the connection is open (read from any thread: a snapshot)."""
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

    def start(self) -> None:
        """Start the thread (again, after a run that ended: every run starts afresh)."""
        if self._thread is not None and self._thread.is_alive():
            raise ReliableAmqpError("the consumer's I/O thread is still running")
        self.stopping.clear()
        self.ended.clear()
        self._drained.clear()
        self.consuming.clear()
        self.fatal = None
        self.acks.clear()
        self._draining = self._cancelled = False
        self.attempts.reset()
        self.last_delivery = None
        self._thread = threading.Thread(target=self._run, name="reliable-amqp-consume", daemon=True)
        self._thread.start()

    def settle(self, generation: int, tag: int, kind: int = ACK, urgent: bool = False) -> None:
        """A delivery is finished (``ACK``) or to go back to the queue (``REQUEUE``).

        Cheap: the frame leaves when a batch is due, on :meth:`flush`, or at once with
        ``urgent``.
        """
        self.acks.add(generation, tag, kind, urgent)

    def flush(self) -> None:
        """Send every ack that is due now (the handler side is idle)."""
        self.acks.flush(self._book)  # read off the I/O thread: at worst one wake-up too many

    @property
    def stale_settlements(self) -> int:
        """Settlements dropped because their channel had died."""
        return self.acks.stale

    @property
    def recoveries(self) -> int:
        """Subscriptions got back after a loss."""
        return self.attempts.recoveries

    def drain(self, timeout: float) -> bool:
        """Stop consuming: cancel the subscription, ack what was settled, requeue the rest.

        Call after the handlers finished (or ran out of time). True once the frames are out.
        """
        self._draining = True
        self.acks.force = True
        connection = self._connection
        if connection is None or self.ended.is_set():
            return True
        call_threadsafe(connection.ioloop, self._on_drain)
        return self._drained.wait(timeout)

    def release(self, timeout: float) -> bool:
        """Give the queue up: send every settlement made, then close the connection (what is
        still unacked goes back to the queue as the subscription ends, in one step: no other
        consumer gets a later message first). True once closed within ``timeout``."""
        connection = self._connection
        self.stopping.set()
        if connection is not None:
            self.acks.force = True
            call_threadsafe(connection.ioloop, functools.partial(self._close, acks=True))
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def cancel(self) -> None:
        """Stop new deliveries (``basic.cancel``); settlements still go out."""
        connection = self._connection
        if connection is not None:
            call_threadsafe(connection.ioloop, lambda: _cancel_subscription(self))

    def stop(self, timeout: float | None = None) -> None:
        """Close the connection and end the thread (unacked deliveries go back to the queue)."""
        self.stopping.set()
        connection = self._connection
        if connection is not None:
            call_threadsafe(connection.ioloop, self._close)
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        own_context()
        try:
            self._connect_loop()
        except BaseException as exc:  # a bug must not leave run() waiting forever
            log.exception("reliable-amqp: consumer I/O thread failed")
            self.fatal = ReliableAmqpError(f"internal error in the consumer's I/O thread: {exc!r}")
        finally:
            self.consuming.clear()
            self.ended.set()
            self._drained.set()

    def _connect_loop(self) -> None:
        index = 0
        while not self.stopping.is_set():
            params = self._params[index % len(self._params)]
            index += 1
            self._loss: ReliableAmqpError | None = None
            connection = ScanningConnection(
                params,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_link_end,
                on_close_callback=self._on_link_end,
            )
            connection.on_deliveries = self._deliver
            self._connection = connection
            self.acks.attach(connection)
            own_loop(connection.ioloop)
            try:
                connection.ioloop.start()
            except Exception as exc:
                log.debug("reliable-amqp: consumer I/O loop failed: %r", exc, exc_info=True)
                if self._loss is None:
                    self._loss = translate_connection_error(exc)
            self._connection = None
            self.acks.attach(None)
            self.node = None
            connection.ioloop.close()
            self._lost_channel()
            if self.stopping.is_set() or self._draining:
                return
            loss = self._loss or ReliableAmqpError("the connection closed")
            if not self._reconnect and self.attempts.subscribed_once and loss.retriable:
                self.attempts.last_loss = str(loss)  # (the owner says it, and what it does)
                return
            if not self._backoff(loss):
                return

    def _backoff(self, loss: ReliableAmqpError) -> bool:
        """Wait before the next connection or channel; False (and ``fatal`` set) when spent."""
        attempts = self.attempts
        allowed = attempts.count(loss)
        if not loss.retriable or not allowed:
            self.fatal = loss if not loss.retriable else attempts.gave_up(self.queue, loss)
            return False
        delay = attempts.delay()
        log.warning(
            "reliable-amqp: consumer of %r lost its subscription (%s); trying again in %.1f s",
            self.queue,
            loss,
            delay,
        )
        return not self.stopping.wait(delay)

    # --- pika callbacks (I/O thread) ----------------------------------------------------------

    def _on_link_end(self, connection: Any, reason: Any) -> None:
        """The connection could not open, or closed: end this connection's loop."""
        if self._loss is None and not self.stopping.is_set():
            self._loss = translate_connection_error(reason)
        connection.ioloop.stop()

    def _on_connection_open(self, connection: ScanningConnection) -> None:
        if self.stopping.is_set():
            connection.close()
            return
        params = connection.params
        self.node = node_of(params.host, params.port)
        self.server_properties = connection.server_properties
        if self._lifecycle is not None:
            self._lifecycle.connected(self.node, product_of(self.server_properties))
        _watch_link(self, connection)
        self._open_channel()

    def _open_channel(self) -> None:
        connection = self._connection
        if connection is None or not connection.is_open or self.stopping.is_set():
            return
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: Channel) -> None:
        connection = self._connection
        assert connection is not None
        self.generation = self._generations() if self._generations else self.generation + 1
        self.live_generation = self.generation
        self._channel = channel
        self._cancelled = False
        self._book = AckBook(self.generation, self.acks.batch)
        connection.scanner = DeliveryScanner(channel.channel_number, self.generation, self.queue)
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_cancel_callback(self._on_server_cancel)
        # A careful start: one message at a time while the broker redelivers (a consumer died
        # with them). A crash loop then charges the broker's delivery count of the poison
        # alone, not of every message prefetched with it; the first fresh delivery opens the
        # full prefetch (see _leave_careful).
        self._careful = self._careful_start and self.prefetch > 1
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
        lifecycle = self._lifecycle
        attempts = self.attempts
        if lifecycle is not None and not self.consuming.is_set():
            lifecycle.subscribed(
                self.node or "?",
                attempts.last_loss if attempts.subscribed_once else None,
                attempts.failures,
                attempts.outage(),
                self.server_properties,
            )
        attempts.recovered()
        self.consuming.set()
        if self._draining:
            self._on_drain()

    def _on_server_cancel(self, _frame: Any) -> None:
        # The queue was deleted or became unavailable. pika forgets the consumer; close the
        # channel (its deliveries go back to the queue) and subscribe again under the policy.
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
        attempts = self.attempts
        allowed = attempts.count(loss)
        if refused is not None and not attempts.subscribed_once:
            attempts.refused += 1
            if attempts.refused >= REFUSED_ATTEMPTS:
                self.fatal = refused
                self.stopping.set()
                connection.close()
                return
        if not allowed:
            self.fatal = attempts.gave_up(self.queue, loss)
            self.stopping.set()
            connection.close()
            return
        delay = attempts.delay()
        log.warning(
            "reliable-amqp: consumer of %r lost its channel (%s); subscribing again in %.1f s",
            self.queue,
            loss,
            delay,
        )
        connection.ioloop.call_later(delay, self._open_channel)

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
        """The redelivered messages are through: consume with the full prefetch.

        RabbitMQ applies a per-consumer ``basic.qos`` to consumers created after it, so the
        subscription is made again on the same channel (the deliveries in hand stay ours, and
        their tags stay valid).
        """
        self._careful = False
        channel = self._channel
        tag = self._consumer_tag
        if channel is None or not channel.is_open or tag is None or self._draining:
            return

        same: Channel = channel

        def live() -> bool:  # still the consuming channel, open and not draining
            return bool(same.is_open) and self._channel is same and not self._draining

        def resubscribe(_frame: Any) -> None:
            if live():
                self._on_declared(None)

        def cancelled(_frame: Any) -> None:
            if live():
                # What the old subscription still holds unacked counts against no consumer's
                # prefetch any more: the new one's is smaller by that much, so the channel never
                # holds more than ``prefetch`` (one less for good, in the usual case: cheaper
                # than a second resubscribe, which could make a quorum queue charge a delivery)
                book = self._book
                held = book.held if book is not None else 0
                window = max(1, self.prefetch - held)
                same.basic_qos(prefetch_count=window, callback=resubscribe)

        # The cancel before the new prefetch: on a quorum queue a basic.qos also raises the
        # credit of the consumer already there, which then takes a message that its cancel
        # gives back, redelivered and charged a delivery (x-delivery-count) it never had.
        self._consumer_tag = None
        channel.basic_cancel(tag, callback=cancelled)

    def _on_drain(self) -> None:
        _cancel_subscription(self)
        self.acks.force = True
        self.acks.send(self._book, self._channel)
        self.acks.requeue_rest(self._book, self._channel)
        self._drained.set()

    def _close(self, acks: bool = False) -> None:
        if acks:  # release(): what was settled goes out first
            self.acks.send(self._book, self._channel)
        connection = self._connection
        if connection is not None and (connection.is_open or connection.is_opening):
            with contextlib.suppress(pika.exceptions.ConnectionWrongStateError):
                connection.close()
        elif connection is not None:
            connection.ioloop.stop()


#: the give-up error (kept here for the loop I/O, which imports it from this module)
_gave_up = gave_up


def _refusal(reason: Any, step: str, queue: str, params: Any) -> ReliableAmqpError | None:
    """A channel closed by the broker's refusal of the set-up ``step`` under way, as an error
    naming the remedy (:mod:`reliable_amqp._core.refusals`); None for any other close."""
    code = getattr(reason, "reply_code", None)
    if not step or type(code) is not int:
        return None
    return refusal_at(
        params, code, str(getattr(reason, "reply_text", "")), operation=step, name=queue
    )


def _watch_link(io: ConsumerIO, connection: ScanningConnection) -> None:
    """Two heartbeats without a byte is a lost link (a frozen node closes nothing): the
    publishers' rule (:class:`~reliable_amqp._core.liveness.LinkWatch`), on a pika timer."""
    watch = LinkWatch()
    watch.reset(time.monotonic(), connection.params.heartbeat or 0)  # the negotiated value
    watch.check(connection.bytes_received, time.monotonic())

    def check() -> None:
        if connection is not io._connection or not connection.is_open:
            return
        now = time.monotonic()
        loss = watch.check(connection.bytes_received, now)
        if loss is not None:
            io._loss = loss
            if not terminate_stream(connection, loss):
                connection.ioloop.stop()
            return
        due = watch.check_at
        if due is not None:
            connection.ioloop.call_later(max(0.0, due - now), check)

    due = watch.check_at
    if due is not None:
        connection.ioloop.call_later(max(0.0, due - time.monotonic()), check)


def _cancel_subscription(io: ConsumerIO) -> None:
    """``basic.cancel`` of the live subscription, if any (I/O thread)."""
    channel = io._channel
    if channel is not None and channel.is_open and io._consumer_tag is not None:
        channel.basic_cancel(io._consumer_tag)
        io._consumer_tag = None
