"""AsyncConsumer: async handlers on the event loop, ``concurrency`` of them at once.

The connection lives on the same event loop (:mod:`reliable_amqp._consume._aio_io`: pika's
``AsyncioConnection`` for set-up and channels, deliveries decoded from each socket read by the
library's scanner, acks batched): a socket read's deliveries reach the workers with no thread in
between. ``concurrency`` workers (tasks made once per run, never one per message) take them in
order; a worker wakes another only when its handler actually suspends, so fast handlers run back
to back in one task. ``handler_timeout`` is one timer for all workers, not a task per message.
Handlers finish in any order and :class:`~reliable_amqp._core.acks.AckBook` never lets a
``multiple`` ack cover one still running.

A handler that blocks the loop stalls its deliveries, acks and the other handlers; a watchdog
thread keeps the heartbeats going meanwhile and says so (see :mod:`._aio_io`).
Another I/O (threads feeding the loop) plugs in through ``ConsumerCore(make_link=...)``: its
batches come through :meth:`AsyncConsumer._on_deliveries` from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from reliable_amqp._consume._aio_io import LoopConsumerIO
from reliable_amqp._consume._aio_run import install_signals, off_the_loop
from reliable_amqp._consume._health import ConsumerHealth
from reliable_amqp._consume._options import (
    DEFAULT_HANDLER_TIMEOUT,
    DEFAULT_PREFETCH,
    DEFAULT_REDELIVERY,
)
from reliable_amqp._consume._stats import ConsumerStats
from reliable_amqp._consume.consumer import ConsumerCore
from reliable_amqp._core.callables import check_handler
from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.policy import RetryPolicy

log = logging.getLogger("reliable_amqp")


class HandlerTimeout(ReliableAmqpError):
    """An async handler ran past ``handler_timeout`` and was cancelled (then retried)."""


class HandlerCancelled(ReliableAmqpError):
    """An async handler raised ``CancelledError`` that nobody asked for: not :meth:`stop`, not
    a cancel of ``run()``, not ``handler_timeout`` (a task it awaited was cancelled, say). It
    counts as a failure (retried, then dead-lettered); a bare ``CancelledError`` out of ``run()``
    always means ``run()`` itself was cancelled."""


class AsyncConsumer:
    """Consume ``queue`` with an async handler, ``concurrency`` deliveries at a time.

    The same contract and options as :class:`~reliable_amqp.Consumer`, plus ``concurrency``
    (1 to ``prefetch``). ``await run(handler)`` returns after :meth:`stop` (or SIGTERM, or the
    first Ctrl-C when the loop runs in the main thread), once the running handlers finished and
    were acked. A handler running past ``handler_timeout`` is cancelled and counts as a failure.
    With ``key``, a key's messages run one at a time, in queue order (different keys at once,
    up to ``concurrency``); see :class:`~reliable_amqp.Consumer` and docs/consumer.md, "Order".
    """

    def __init__(
        self,
        url: str | Sequence[str],
        queue: str,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        concurrency: int = 1,
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
            "concurrency": concurrency,
            "redelivery": redelivery,
            "dead_letter_queue": dead_letter_queue or "",
            "stop_timeout": stop_timeout,
            "handler_timeout": handler_timeout,
            "declare": declare,
            "queue_arguments": queue_arguments,
            "consumer_arguments": consumer_arguments,
            "attempts": attempts,
        }
        self._ready: deque[Delivery] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        #: workers waiting for deliveries (each on a future of its own)
        self._idle: deque[asyncio.Future[None]] = deque()
        self._kick_pending = False
        self._wake_pending = False
        self._wake_lock = threading.Lock()
        self._stopping = False
        self._running = False
        #: set when run() cancels its workers: only then is a CancelledError theirs to raise
        self._cancelling = False
        #: a BaseException (SystemExit...) a handler raised: it ends run() and propagates
        self._halt: BaseException | None = None
        #: when each worker's running handler started (None: idle), for health() and timeouts
        self._starts: list[float | None] = []
        #: the start of the handler call each worker was cancelled for (handler_timeout)
        self._timed_out: list[float | None] = []
        self._deadline: asyncio.TimerHandle | None = None
        self._ended_check: asyncio.TimerHandle | None = None
        self._workers: list[asyncio.Task[None]] = []
        #: keys a worker holds -> their deliveries waiting for it, in arrival order
        self._keys: dict[str, deque[Delivery]] = {}
        self._core = ConsumerCore(
            url, queue, own, options, self._on_deliveries, make_link=LoopConsumerIO
        )
        self.options = self._core.options

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

    # --- the I/O's side ---------------------------------------------------------------------------

    def _on_deliveries(self, batch: list[Delivery]) -> None:
        """A batch of deliveries, from the loop's own I/O or from any other thread."""
        self._ready.extend(batch)
        if threading.get_ident() == self._loop_thread:
            self._wake_one()
        else:
            self._poke()

    def _poke(self) -> None:
        """Wake the loop from another thread (once, however many batches arrive meanwhile)."""
        loop = self._loop
        if loop is None:
            return
        with self._wake_lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the loop closed: run() is over
            loop.call_soon_threadsafe(self._on_poke)

    def _on_poke(self) -> None:
        with self._wake_lock:
            self._wake_pending = False
        if self._stopping:
            self._wake_all()
        else:
            self._wake_one()

    def _wake_one(self) -> None:
        """Wake an idle worker (it wakes the next one if its handler suspends: ``_kick``)."""
        idle = self._idle
        while idle:
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _wake_all(self) -> None:
        idle = self._idle
        while idle:
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _kick(self) -> None:
        """A handler suspended with deliveries still waiting: another worker takes the next."""
        self._kick_pending = False
        if self._ready or self._stopping:
            self._wake_one()

    def _check_ended(self) -> None:
        """Once a second: an I/O that ended for good (any kind of link) ends the workers."""
        loop = self._loop
        if loop is None or not self._running:
            return
        if self._core.io.ended.is_set() and self._workers:
            self._wake_all()
        self._ended_check = loop.call_later(1.0, self._check_ended)

    def _arm_deadline(self, started: float) -> None:
        loop = self._loop
        timeout = self.options.handler_timeout
        if loop is None or timeout is None:
            return
        self._deadline = loop.call_later(
            max(0.0, started + timeout - time.monotonic()), self._check_deadlines
        )

    def _check_deadlines(self) -> None:
        """Cancel each handler past ``handler_timeout``; the timer again for the next one."""
        self._deadline = None
        timeout = self.options.handler_timeout
        if timeout is None:
            return
        now = time.monotonic()
        earliest: float | None = None
        for index, started in enumerate(self._starts):
            if started is None:
                continue
            if now - started >= timeout:
                if self._timed_out[index] != started:
                    self._timed_out[index] = started
                    self._workers[index].cancel()
            elif earliest is None or started < earliest:
                earliest = started
        if earliest is not None:
            self._arm_deadline(earliest)

    # --- the caller's side --------------------------------------------------------------------

    def health(self) -> ConsumerHealth:
        """Whether this consumer is running, connected and subscribed, the age of its last
        delivery and of its longest-running handler (any thread; see ``ConsumerHealth``)."""
        started = [t for t in list(self._starts) if t is not None]
        return self._core.health(self._running, min(started) if started else None)

    def stop(self) -> None:
        """Ask :meth:`run` to return (any thread, or from inside a handler)."""
        self._stopping = True
        if threading.get_ident() == self._loop_thread:
            self._wake_all()
        else:
            self._poke()

    async def __aenter__(self) -> AsyncConsumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()

    async def run(self, handler: Callable[[Delivery], Awaitable[Any]]) -> None:
        """Consume until :meth:`stop`; each delivery goes to ``await handler(delivery)``.

        A plain function (or a generator function) is refused before anything is consumed
        with :class:`~reliable_amqp.WrongHandlerKind`. A ``SystemExit``, ``KeyboardInterrupt``
        or other ``BaseException`` from a handler ends ``run()`` as it ends the sync
        consumer's: that message goes back to the queue, the connections close, and the
        exception propagates. ``run`` may be called again after it returned.
        """
        check_handler(handler, want_async=True, where="AsyncConsumer.run")
        if self._running:
            raise ReliableAmqpError("run() is already running for this consumer")
        self._running = True
        self._cancelling = False
        self._halt = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        core = self._core
        io = core.io
        if isinstance(io, LoopConsumerIO):
            io.bind(loop)
            io.on_end = self._wake_all
        restore = install_signals(loop, self.stop)
        graceful = True
        workers: list[asyncio.Task[None]] = []
        running = 0
        self._ended_check = loop.call_later(1.0, self._check_ended)
        try:
            await loop.run_in_executor(None, core.start)
            count = self.options.concurrency
            self._starts = [None] * count
            self._timed_out = [None] * count
            workers = [loop.create_task(self._worker(handler, i)) for i in range(count)]
            self._workers = workers
            # asyncio.wait, not gather: a cancel of run() does not reach the workers by itself,
            # so a CancelledError inside a handler is told apart from this consumer's own
            await asyncio.wait(workers)
        except BaseException:
            graceful = False
            raise
        finally:
            self._stopping = True
            if self._ended_check is not None:
                self._ended_check.cancel()
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            if isinstance(self._halt, KeyboardInterrupt):
                graceful = False
            running = sum(1 for t in workers if not t.done())
            self._cancelling = True
            for task in workers:
                task.cancel()
            if workers:
                await asyncio.gather(*workers, return_exceptions=True)
            try:
                # closing blocks (it waits for confirms): off the loop, which keeps running
                await off_the_loop(loop, self._core.finish, graceful, running, len(self._ready))
            finally:
                self._ready.clear()
                self._idle.clear()
                self._stopping = False  # run() may be called again; a stop() before it is kept
                self._starts = []
                self._workers = []
                self._keys.clear()
                restore()
                self._loop = None
                self._loop_thread = 0
                self._running = False
        if self._halt is not None:
            raise self._halt
        for task in workers:  # a worker that failed is a bug: not lost in the tasks
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if io.fatal is not None:
            raise io.fatal

    async def _worker(self, handler: Callable[[Delivery], Awaitable[Any]], index: int) -> None:
        loop = asyncio.get_running_loop()
        ready = self._ready
        idle = self._idle
        starts = self._starts
        timed_out = self._timed_out
        core = self._core
        dispatch = core.dispatch
        stats = core.stats
        io = core.io
        ended = io.ended
        timeout = self.options.handler_timeout
        counter = self.options.attempts
        clock = time.monotonic
        key_of = dispatch.key_of
        keys = self._keys
        current = asyncio.current_task()
        uncancel: Callable[[], object] | None = getattr(current, "uncancel", None)
        held: str | None = None  # the key this worker holds (its next delivery comes first)
        while True:
            if self._stopping or ended.is_set():
                return
            if held is not None:
                waiting = keys[held]
                if waiting:
                    delivery = waiting.popleft()
                    key: str | None = held
                else:
                    del keys[held]
                    held = None
                    continue
            else:
                try:
                    delivery = ready.popleft()
                except IndexError:
                    io.flush()
                    waiter: asyncio.Future[None] = loop.create_future()
                    idle.append(waiter)
                    await waiter
                    continue
                key = None
                if key_of is not None:
                    try:
                        key = key_of(delivery)
                    except Exception as exc:  # the key callable failed: a failure
                        if dispatch.fresh(delivery):
                            dispatch.failed(delivery, exc)
                        continue
                    if key is not None:
                        if key in keys:  # another worker holds the key: after its delivery
                            keys[key].append(delivery)
                            continue
                        keys[key] = deque()
                        held = key
            if not dispatch.fresh(delivery):
                continue
            if counter is not None and delivery.redelivered:
                try:
                    counted = counter(delivery)
                    if inspect.isawaitable(counted):
                        counted = await counted
                    dispatch.count_attempt(delivery, counted)
                except Exception as exc:  # the count is unknown: try again later
                    dispatch.failed(delivery, exc)
                    continue
            if dispatch.dead_before(delivery):
                continue
            if key is not None and dispatch.park(delivery, key):
                continue
            telemetry = dispatch.telemetry
            span = telemetry.begin(delivery) if telemetry is not None else None
            error: Exception | None = None
            started = starts[index] = clock()
            if timeout is not None and self._deadline is None:
                self._arm_deadline(started)
            if ready and idle and not self._kick_pending:
                # runs only once this handler suspends: then another worker takes the next
                self._kick_pending = True
                loop.call_soon(self._kick)
            try:
                await handler(delivery)
            except asyncio.CancelledError:
                if self._cancelling:
                    raise  # run() ends: the message stays unacked and goes back
                if timed_out[index] == started:
                    error = HandlerTimeout(
                        f"the handler ran past handler_timeout={timeout} s and was cancelled"
                    )
                else:
                    error = HandlerCancelled(
                        "the handler raised CancelledError that neither stop(), a cancel of "
                        "run() nor handler_timeout asked for"
                    )
                dispatch.failed(delivery, error, key)
            except Exception as exc:
                error = exc
                dispatch.failed(delivery, exc, key)
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: the message goes back
                self._halted(exc)
                return
            else:
                dispatch.succeeded(delivery, key)
            finally:
                starts[index] = None
                if timed_out[index] == started:  # this worker's cancel was ours: taken back
                    timed_out[index] = None
                    if uncancel is not None:
                        uncancel()
                seconds = clock() - started
                stats.handler_seconds += seconds
                if telemetry is not None:
                    telemetry.end(span, error, seconds)

    def _halted(self, exc: BaseException) -> None:
        """A handler raised a BaseException: no new handler starts; on KeyboardInterrupt the
        running ones are cancelled too (their messages go back), as Ctrl-C does in the sync
        consumer. run() raises ``exc`` once closed."""
        if self._halt is None:
            self._halt = exc
        self._stopping = True
        if isinstance(exc, KeyboardInterrupt):
            self._cancelling = True
            current = asyncio.current_task()
            for task in self._workers:
                if task is not current:
                    task.cancel()
        self._wake_all()
