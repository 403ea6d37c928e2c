"""Consumer: handlers called on the caller's thread, the connection on an I/O thread of its own.

See docs/consumer.md for the contract. The I/O thread (:class:`ConsumerIO`) decodes deliveries
and hands them over in batches; :meth:`Consumer.run` takes them one at a time, calls the handler
and settles each (ack after the work; a failure is republished to a delay queue or the dead
letters first). Because the handler never runs on the I/O thread, heartbeats keep flowing
while it works.
"""

from __future__ import annotations

import functools
import inspect
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import pika

from reliable_amqp._consume._dispatch import Dispatch
from reliable_amqp._consume._group import PartitionGroup
from reliable_amqp._consume._health import ConsumerHealth, snapshot
from reliable_amqp._consume._io import ConsumerIO
from reliable_amqp._consume._lifecycle import Lifecycle
from reliable_amqp._consume._link import ConsumerLink
from reliable_amqp._consume._options import (
    DEFAULT_HANDLER_TIMEOUT,
    DEFAULT_PREFETCH,
    DEFAULT_REDELIVERY,
    ConsumerOptions,
)
from reliable_amqp._consume._redeliver import Redeliverer
from reliable_amqp._consume._stats import ConsumerStats
from reliable_amqp._core.callables import WrongHandlerKind, check_handler, returned_awaitable
from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.errors import ConfigurationError, ReliableAmqpError
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._otel import otel_in_use
from reliable_amqp._sync._events import SignalSafeEvent
from reliable_amqp._sync._pika import connection_parameters

if TYPE_CHECKING:
    from reliable_amqp._otel._consume import ConsumerTelemetry

log = logging.getLogger("reliable_amqp")

#: a consumer keeps trying to get its subscription back for 10 minutes, then run() raises
CONSUMER_CONNECT_POLICY = RetryPolicy(
    max_attempts=None, initial_delay=0.2, max_delay=15.0, multiplier=2.0, jitter=0.2, deadline=600.0
)


class LinkFactory(Protocol):
    """Builds a consumer's I/O (:class:`ConsumerIO` by default), as ConsumerIO is built."""

    def __call__(
        self,
        params: list[pika.URLParameters],
        queue: str,
        *,
        prefetch: int,
        connect_policy: RetryPolicy,
        on_deliveries: Callable[[list[Delivery]], None],
        declare: dict[str, Any] | None,
        consumer_arguments: dict[str, Any],
        lifecycle: Lifecycle,
    ) -> ConsumerLink: ...


class ConsumerCore:
    """What :class:`Consumer` and :class:`AsyncConsumer` build the same way: options, the I/O
    thread, the redeliverer and the dispatch."""

    def __init__(
        self,
        url: str | Sequence[str],
        queue: str,
        own: Mapping[str, Any],
        options: dict[str, Any],
        on_deliveries: Callable[[list[Delivery]], None],
        *,
        make_link: LinkFactory | None = None,
    ) -> None:
        options.setdefault("connect_policy", CONSUMER_CONNECT_POLICY)
        try:
            self.options = ConsumerOptions.create(url, queue, own, options)
        except ConfigurationError as exc:
            raise ConfigurationError(
                str(exc).replace("publisher option", "consumer option")
            ) from None
        opts = self.options
        params = [connection_parameters(u, opts.connection) for u in opts.connection.urls]
        declare = None
        if opts.declare or opts.queue_arguments is not None:
            declare = {"durable": True, "arguments": dict(opts.queue_arguments or {}) or None}
        self.stats = ConsumerStats()
        self.lifecycle = Lifecycle(opts)
        if opts.partitions is not None:  # a group of partitions, whatever feeds one queue
            make_link = self._group_factory()
        self.io: ConsumerLink = (make_link or ConsumerIO)(
            params,
            opts.queue,
            prefetch=opts.prefetch,
            connect_policy=opts.connection.connect_policy,
            on_deliveries=on_deliveries,
            declare=declare,
            consumer_arguments=dict(opts.consumer_arguments or {}),
            lifecycle=self.lifecycle,
        )
        self.redeliver = Redeliverer(opts, self.io, self.stats)
        self.dispatch = Dispatch(opts, self.io, self.redeliver, self.stats)

    def _group_factory(self) -> LinkFactory:
        """A partitioned consumer's link: its member of the group (``_consume/_group.py``)."""
        opts = self.options
        assert opts.partitions is not None

        def keep() -> set[int]:  # partitions whose keys wait for a retry here: not moved
            follow = self.dispatch.fences.follow_queues()
            return {i for i, q in enumerate(opts.consumed_queues) if opts.follow_queue(q) in follow}

        return functools.partial(
            PartitionGroup, partitions=opts.partitions, stop_timeout=opts.stop_timeout, keep=keep
        )

    def start(self) -> None:
        """Open the redelivery publisher (declaring the delay and dead-letter queues), then
        start consuming."""
        self.dispatch.telemetry = self.redeliver.telemetry = _telemetry(self.options)
        self.lifecycle.begin()
        self.redeliver.open()
        self.io.start()

    def health(self, running: bool, handler_started: float | None) -> ConsumerHealth:
        """A snapshot for :meth:`Consumer.health` (any thread)."""
        io = self.io
        held = tuple(io.held) if isinstance(io, PartitionGroup) else None
        return snapshot(
            running=running,
            connected=io.connected,
            subscribed=io.consuming.is_set(),
            node=io.node,
            last_delivery=io.last_delivery,
            handler_started=handler_started,
            handler_timeout=self.options.handler_timeout,
            partitions=held,
        )

    def finish(self, graceful: bool, running: int = 0, waiting: int = 0) -> None:
        """Stop: with ``graceful``, wait for republishes, ack what finished and requeue the
        rest before closing; without, close at once (the broker requeues what is unacked).

        ``running`` handlers are still at work (async, past the stop's wait) and ``waiting``
        deliveries were never started: both go back to the queue.
        """
        try:
            self._finish(graceful, running, waiting)
        finally:
            self.lifecycle.stopped(self.stats)

    def _finish(self, graceful: bool, running: int, waiting: int) -> None:
        timeout = self.options.stop_timeout
        io = self.io
        if graceful and not io.ended.is_set():
            self.lifecycle.stopping(running, waiting, self.redeliver.pending)
            io.cancel()
            left = self.redeliver.flush(timeout)
            if left:
                log.warning(
                    "reliable-amqp: %d retries or dead letters of queue %r were not confirmed "
                    "within stop_timeout=%.0f s; their originals go back to the queue",
                    left,
                    self.options.queue,
                    timeout,
                )
            io.drain(max(1.0, timeout))
        io.stop(timeout=max(1.0, timeout) if graceful else 2.0)
        self.redeliver.close(timeout if graceful else 0.0)


def _telemetry(options: ConsumerOptions) -> ConsumerTelemetry | None:
    if not otel_in_use(options.connection):
        return None  # OpenTelemetry is not imported at all
    try:
        from reliable_amqp._otel._consume import consumer_telemetry
    except ImportError:  # the otel extra is not installed
        return None
    return consumer_telemetry(options.connection, options.queue)


class Consumer:
    """Consume ``queue`` losslessly: ack after the work, retry later, dead-letter with a reason.

    ``Consumer(url, queue, prefetch=100, redelivery=RetryPolicy(...), heartbeat=5)``, then
    ``run(handler)``: ``handler(delivery)`` is called for each message on the calling thread;
    when it returns the message is acked, when it raises it is republished to a delay queue and
    tried again after the ``redelivery`` policy's delay, and after ``max_attempts`` (or at once
    on :class:`Reject`) it goes to ``<queue>.dead`` with its reason. ``run`` returns after
    :meth:`stop`, SIGTERM or Ctrl-C (main thread), once the running handler finished and was
    acked and the unstarted messages went back to the queue; a second Ctrl-C closes at once.

    Options: ``prefetch`` (1 to 65,535), ``redelivery`` (a :class:`RetryPolicy` with
    ``max_attempts``), ``dead_letter_queue`` (default ``<queue>.dead``), ``stop_timeout``,
    ``handler_timeout`` (a handler running longer is warned about once: keep it under the
    broker's ``consumer_timeout``), ``declare``/``queue_arguments`` (declare the queue, durable,
    and again after every reconnect), ``consumer_arguments`` (``basic.consume`` arguments), and
    every connection option :class:`~reliable_amqp.Publisher` takes (``heartbeat``, TLS,
    credentials, ``connect_policy``...).

    ``key`` keeps per-key order ("routing_key", "header:<name>", or a callable
    ``delivery -> str | None``): a key's messages are handled in the order the queue delivered
    them, and while one of them is retried the key's later messages wait for it (parked in the
    broker, behind it; other keys flow). ``after_dead_letter`` ("continue", the default, or
    "hold") says whether a key goes on after one of its messages was dead-lettered. See
    docs/consumer.md, "Order".

    ``partitions=N`` makes ``queue`` the name of a group: the consumer consumes its share of
    the partition queues ``<queue>.0`` .. ``<queue>.<N-1>`` (bound to the consistent-hash
    exchange ``<queue>``, declared with ``declare=True``), one member per partition at a time,
    shared evenly with every other consumer of the group and taken over within seconds when one
    dies. See docs/consumer.md, "Partitions".
    """

    def __init__(
        self,
        url: str | Sequence[str],
        queue: str,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        redelivery: RetryPolicy | Mapping[str, Any] = DEFAULT_REDELIVERY,
        heartbeat: int | None = None,
        dead_letter_queue: str | None = None,
        stop_timeout: float = 30.0,
        handler_timeout: float | None = DEFAULT_HANDLER_TIMEOUT,
        declare: bool = False,
        queue_arguments: Mapping[str, Any] | None = None,
        consumer_arguments: Mapping[str, Any] | None = None,
        attempts: Callable[[Delivery], Any] | None = None,
        key: str | Callable[[Delivery], str | None] | None = None,
        after_dead_letter: str = "continue",
        partitions: int | None = None,
        **options: Any,
    ) -> None:
        if heartbeat is not None:
            options["heartbeat"] = heartbeat
        own = {
            "partitions": partitions,
            "key": key,
            "after_dead_letter": after_dead_letter,
            "prefetch": prefetch,
            "redelivery": redelivery,
            "dead_letter_queue": dead_letter_queue or "",
            "stop_timeout": stop_timeout,
            "handler_timeout": handler_timeout,
            "declare": declare,
            "queue_arguments": queue_arguments,
            "consumer_arguments": consumer_arguments,
            "attempts": attempts,
        }
        self._queue: deque[Delivery] = deque()
        self._cond = threading.Condition()
        self._waiting = False
        self._stop = SignalSafeEvent()  # set by stop(), which the signal handlers call
        # stop() was asked: what the loop reads before each delivery (the event's is_set() is
        # a Python call a message); the event is what waits are woken by
        self._stop_asked = False
        self._running = False
        self._core = ConsumerCore(url, queue, own, options, self._on_deliveries)
        self.options = self._core.options
        self._handler_started: float | None = None
        self._wrong_kind: WrongHandlerKind | None = None

    @property
    def own_queues(self) -> tuple[str, ...]:
        """The queues this consumer declares for itself (durable, kept after it stops): its
        dead-letter queue, then one delay queue per delay level of its ``redelivery`` policy
        (``<queue>.retry.<ms>ms``, each dead-lettering back to the queue)."""
        return self.options.own_queues

    @property
    def stats(self) -> ConsumerStats:
        """Counters: consumed, handled, retried, dead-lettered, redelivered... (live)."""
        return self._core.stats

    # --- the I/O thread's side ----------------------------------------------------------------

    def _on_deliveries(self, batch: list[Delivery]) -> None:
        self._queue.extend(batch)
        if self._waiting:
            with self._cond:
                self._cond.notify()

    # --- the caller's side --------------------------------------------------------------------

    def health(self) -> ConsumerHealth:
        """Whether this consumer is running, connected and subscribed, the age of its last
        delivery and of its running handler (any thread; see :class:`ConsumerHealth`)."""
        return self._core.health(self._running, self._handler_started)

    def stop(self) -> None:
        """Ask :meth:`run` to return (any thread, a signal handler, or the handler itself)."""
        self._stop_asked = True
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def run(self, handler: Callable[[Delivery], Any]) -> None:
        """Consume until :meth:`stop`, SIGTERM or Ctrl-C; each delivery goes to ``handler``.

        Raises what ended consuming for good: :class:`~reliable_amqp.RecoveryFailed` once the
        connect policy is spent, :class:`~reliable_amqp.AuthenticationFailed`, a refused queue
        (:class:`~reliable_amqp.QueueNotFound`, ``AccessRefused`` naming the permission)...
        An ``async def`` handler (or a generator function) is refused before anything is
        consumed with :class:`~reliable_amqp.WrongHandlerKind`. ``run`` may be called again
        after it returned.
        """
        check_handler(handler, want_async=False, where="Consumer.run")
        if self._running:
            raise ReliableAmqpError("run() is already running for this consumer")
        self._running = True
        self._wrong_kind = None
        core = self._core
        restore = self._install_signals()
        graceful = True
        watchdog = self._start_watchdog()
        try:
            core.start()
            self._loop(handler)
        except KeyboardInterrupt:
            graceful = False
            raise
        finally:
            self._stop.set()
            try:
                core.finish(graceful, waiting=len(self._queue))
            finally:
                self._queue.clear()
                restore()
                if watchdog is not None:
                    watchdog.join(1.0)
                self._stop.clear()  # run() may be called again; a stop() before it is kept
                self._stop_asked = False
                self._running = False
        if self._wrong_kind is not None:
            raise self._wrong_kind
        if core.io.fatal is not None:
            raise core.io.fatal

    def _loop(self, handler: Callable[[Delivery], Any]) -> None:
        queue = self._queue
        dispatch = self._core.dispatch
        stats = self._core.stats
        stop = self._stop
        io = self._core.io
        counter = self.options.attempts
        key_of = dispatch.key_of
        max_attempts = self.options.max_attempts  # (dead_before's own test, in line)
        clock = time.monotonic
        while True:
            try:
                delivery = queue.popleft()
            except IndexError:
                if stop.is_set() or io.ended.is_set():
                    return
                io.flush()  # idle: what finished is acked now
                with self._cond:
                    self._waiting = True
                    if not queue and not stop.is_set() and not io.ended.is_set():
                        # the timeout only bounds how late an ended I/O thread is noticed
                        self._cond.wait(1.0)
                    self._waiting = False
                continue
            if self._stop_asked:
                return  # unstarted: given back to the queue by the drain
            if not dispatch.fresh(delivery):
                continue
            if counter is not None and delivery.redelivered:
                try:
                    dispatch.count_attempt(delivery, counter(delivery))
                except Exception as exc:  # the count is unknown: try again later
                    dispatch.failed(delivery, exc)
                    continue
            if (
                delivery.header_error is not None or delivery.attempt > max_attempts
            ) and dispatch.dead_before(delivery):
                continue
            key = None
            if key_of is not None:
                try:
                    key = key_of(delivery)
                except Exception as exc:  # the key callable failed: a failure like any other
                    dispatch.failed(delivery, exc)
                    continue
                if key is not None and dispatch.park(delivery, key):
                    continue
            telemetry = dispatch.telemetry
            span = telemetry.begin(delivery) if telemetry is not None else None
            error: Exception | None = None
            started = self._handler_started = clock()
            try:
                result = handler(delivery)
            except Exception as exc:
                error = exc
                dispatch.failed(delivery, exc, key)
            else:
                if result is not None and inspect.isawaitable(result):
                    # a plain callable around an async one: nothing ran; the message is left
                    # unsettled (the drain gives it back) and run() raises
                    self._wrong_kind = returned_awaitable(result, "Consumer.run")
                    return
                dispatch.succeeded(delivery, key)
            finally:
                self._handler_started = None
                seconds = clock() - started
                stats.handler_seconds += seconds
                if telemetry is not None:
                    telemetry.end(span, error, seconds)

    def _install_signals(self) -> Callable[[], None]:
        """SIGTERM stops; the first Ctrl-C stops, the second raises (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        presses = 0

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            nonlocal presses
            presses += 1
            if presses > 1:
                raise KeyboardInterrupt
            log.info("reliable-amqp: stopping the consumer (Ctrl-C again to stop at once)")
            self.stop()

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            self.stop()

        old_int = signal.signal(signal.SIGINT, on_sigint)
        old_term = signal.signal(signal.SIGTERM, on_sigterm)

        def restore() -> None:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)

        return restore

    def _start_watchdog(self) -> threading.Thread | None:
        """Warn once per handler call that runs past ``handler_timeout``."""
        limit = self.options.handler_timeout
        if limit is None:
            return None

        def watch() -> None:
            warned: float | None = None
            while not self._stop.wait(min(limit / 4, 5.0)):
                started = self._handler_started
                if started is None or started == warned:
                    continue
                if time.monotonic() - started > limit:
                    warned = started
                    log.warning(
                        "reliable-amqp: a handler of queue %r has run for more than "
                        "handler_timeout=%.0f s; the broker's consumer_timeout may close the "
                        "channel and redeliver the message",
                        self.options.queue,
                        limit,
                    )

        thread = threading.Thread(target=watch, name="reliable-amqp-consume-watchdog", daemon=True)
        thread.start()
        return thread
