"""AsyncPublisher: streaming publisher confirms for asyncio, on aio-pika's connection.

The connection is aio-pika's (``aio_pika.connect``, or one the caller lends), but publishing goes
beneath aio-pika: the publisher opens its own confirm-mode channel on the underlying aiormq
connection, writes marshalled ``basic.publish`` frames in batches straight to that connection's
write queue, and reads acks, nacks and returns from the channel into the :class:`PublishEngine`.
aio-pika's per-message path (a ``Message``, a channel lock, a confirmation future and an awaited
socket drain per publish) is what limits its throughput; ``docs/async.md`` has the figures.

This module is the caller's side: validation, the in-flight window, futures and ``flush``. The
tasks that talk to the broker are in :mod:`._link` (the connection's life) and :mod:`._pump`
(the traffic). Everything runs on one event loop, so the
engine needs no lock.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aio_pika.abc

from reliable_amqp._async import _topology
from reliable_amqp._async._connect import ConnectionSource
from reliable_amqp._async._future import AsyncPublishFuture, entry_maker, future_of
from reliable_amqp._async._link import Link
from reliable_amqp._async._pump import Pump
from reliable_amqp._async._spooled import AsyncSpooled
from reliable_amqp._compat.waits import wait_for
from reliable_amqp._core.admission import NO_ROOM, Admission
from reliable_amqp._core.builder import MessageBuilder
from reliable_amqp._core.entry import CONFIRMED, Entry, new_entry
from reliable_amqp._core.errors import (
    ConfigurationError,
    OperationTimeout,
    PublisherClosed,
    PublishTimeout,
)
from reliable_amqp._core.message import Confirmation
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.stats import Stats
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.topology import Topology, TopologyOp
from reliable_amqp._core.window import Flush, Window
from reliable_amqp._otel import TelemetrySlot
from reliable_amqp._surface import PublisherSurface
from reliable_amqp._unclosed import report_unclosed

if TYPE_CHECKING:
    from reliable_amqp._otel._telemetry import Telemetry


_BASE_CREATE_FUTURE = asyncio.BaseEventLoop.create_future
InvalidStateError = asyncio.InvalidStateError
# new_confirmation()'s way (through the frozen dataclass's slots), inlined in _resolve
_new = object.__new__
_set_confirmed_id: Callable[[object, str], None] = vars(Confirmation)["message_id"].__set__
_set_attempts: Callable[[object, int], None] = vars(Confirmation)["attempts"].__set__

_FIX = "Call `await publisher.aclose()` (or use `async with`) before the event loop ends."

#: the caller's future of a message
Handle = asyncio.Future[Confirmation]
#: what the async publisher's engine holds per message: its entry, the caller's future its handle
AsyncEntry = Entry[Handle]


@dataclass(slots=True, eq=False)
class _Open:
    """Whether an AsyncPublisher was closed, and what reporting it needs: its finalizer holds
    this, not the publisher."""

    name: str
    window: Window
    spool: str | None
    started: bool = False
    closed: bool = False
    reported: bool = False

    def report(self, what: str, fate: str) -> None:
        """Report the publisher as not closed (once)."""
        if self.started and not self.closed and not self.reported:
            self.reported = True
            report_unclosed(f"{self.name} {what}", self.window.count, fate, self.spool, _FIX)


def _collected(state: _Open) -> None:
    state.report(
        "was garbage-collected (or the interpreter exited) while open",
        "nothing can confirm them now",
    )


class AsyncPublisher(
    PublisherSurface[
        Coroutine[Any, Any, None],
        Coroutine[Any, Any, str],
        Coroutine[Any, Any, asyncio.Future[Confirmation]],
        Coroutine[Any, Any, list[asyncio.Future[Confirmation]]],
    ]
):
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
            # The options need a URL; the connection's own is the truthful one (for reprs). Its
            # query holds aio-pika's settings (reconnect_interval, ...), which are the owner's
            # business, not publisher options: leave it out.
            url = str(getattr(connection, "url", "") or "amqp://aio-pika-connection/")
            url = url.partition("?")[0]
        assert url is not None
        self.options = PublisherOptions.create(url, **options)
        self._supervisor: Supervisor[AsyncEntry] = Supervisor(
            self.options, borrowed=connection is not None
        )
        #: checks and builds each message: as an engine entry (the caller's future its handle)
        self._builder: MessageBuilder[AsyncEntry] = self._init_builder(new_entry)
        self._window = Window(self.options.max_in_flight, self.options.max_in_flight_bytes)
        self._topology = Topology()
        self._pump = Pump(self._supervisor, resolve=self._resolve)
        self._link = Link(
            self._supervisor,
            ConnectionSource(self.options, connection),
            self._topology,
            self._pump,
            on_end=self._on_end,
        )
        #: publishes waiting for room in the window, first come first served
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        #: the event loop, once the link is ready (publish() need not connect)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: whether a publish goes in now (the core's)
        #: (a KeyboardInterrupt in an admission gives the room back unless the engine took it)
        self._admission: Admission[AsyncEntry] = Admission(
            self._window,
            self._pump.take,
            self._pump.take_run,
            self._room_waiters,
            took=self._pump.holds,
        )
        urls = ", ".join(redact_url(u) for u in self.options.urls)
        self._open = _Open(f"AsyncPublisher [{urls}]", self._window, self.options.spool)
        state = self._open
        self._link.on_abandoned = lambda: state.report(
            "was not closed before its event loop stopped",
            "they failed with PublisherClosed",
        )
        weakref.finalize(self, _collected, state)
        #: OpenTelemetry, decided at connect() (None: off; see docs/observability.md)
        self._otel = TelemetrySlot()
        self._telemetry: Telemetry | None = None
        #: the durable spool's part (spool=DIR): opening it takes its lock, or raises
        self._spooled: AsyncSpooled | None = (
            AsyncSpooled(self.options, self._supervisor, self._window, self._pump.take_run)
            if self.options.spool is not None
            else None
        )

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

    # --- lifecycle ---------------------------------------------------------------------------

    async def connect(self) -> AsyncPublisher:
        """Open the connection and channel (retrying under ``connect_policy``); raise if that fails.

        Called by ``async with`` and by the first ``publish()``. Wrong credentials raise
        :class:`AuthenticationFailed` at once; other failures raise :class:`RecoveryFailed` once
        the connect policy is spent.
        """
        link = self._link
        if not self._admission.accepting:
            raise PublisherClosed.refused("connect()")
        if not link.started:
            self._telemetry = self._otel.decide(self.options, self._supervisor, self.stats)
            self._admission.telemetry = self._telemetry
            self._open.started = True
            link.start()
            if self._spooled is not None:
                self._spooled.start(link.loop)
        if self._spooled is not None:
            return self  # connects in the background; publish() goes to the spool meanwhile
        await link.ready.wait()
        loop = link.loop
        if self._spooled is None and type(loop).create_future is _BASE_CREATE_FUTURE:
            # the loop makes plain asyncio futures: from now on each message's future is its
            # entry (one object a message in flight; the spool's feed needs them apart)
            self._builder.make_with(entry_maker(loop))
        self._loop = loop
        if link.fatal is not None:
            raise link.fatal
        if not self._admission.accepting:
            raise PublisherClosed.refused("connect()", reason="closed while connecting")
        return self

    async def __aenter__(self) -> AsyncPublisher:
        try:
            return await self.connect()
        except BaseException:
            # no __aexit__ follows a failed __aenter__: closed here, or it would be reported
            # unclosed (a ResourceWarning telling to use `async with`, which the caller did)
            await self.aclose()
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self, timeout: float | None = None) -> int:
        """Flush (up to ``timeout``, default ``close_timeout``), then close.

        Whatever is still unresolved then fails with :class:`PublisherClosed`: when ``aclose()``
        returns, every future this publisher handed out is resolved. Returns how many failed so.
        A lent aio-pika connection stays open; only the publisher's channel is closed.
        """
        self._admission.accepting = False
        self._open.closed = True
        self._release_room_waiters()
        link = self._link
        wait = self.options.close_timeout if timeout is None else timeout
        if not link.started:
            link.ready.set()
            if self._spooled is not None:
                await self._spooled.aclose(wait)
            return 0
        left = 0
        try:
            if not link.stopping:
                left = await self.flush(wait)
        finally:
            # Even when aclose() itself is cancelled, nothing stays unresolved.
            self._pump.accept_pending()
            self._resolve(self._supervisor.shutdown())
            link.stop()
        await link.join()
        if self._spooled is not None:  # what is left stays in the spool for the next publisher
            await self._spooled.aclose(wait)
        if self._telemetry is not None:
            self._telemetry.close()
        return left

    async def close(self, timeout: float | None = None) -> int:
        """:meth:`aclose` under the name aio-pika's objects use (``await publisher.close()``)."""
        return await self.aclose(timeout)

    # --- topology ----------------------------------------------------------------------------

    async def _declare(self, op: TopologyOp, timeout: float | None) -> Any:
        link = self._link
        call = f"declaring {op.describe()}"
        self._check_usable(call)
        if not link.ready.is_set():
            await self.connect()
        self._check_usable(call)
        wait = self.options.connect_timeout if timeout is None else timeout
        try:  # while the publisher recovers, the declaration waits for the next channel
            await wait_for(link.opened.wait(), wait)
        except (asyncio.TimeoutError, TimeoutError):
            self._check_usable(call)  # closed or failed meanwhile: say that, not "timeout"
            raise OperationTimeout(
                f"no connection to declare {op.describe()} within {wait:g} s"
            ) from None
        self._check_usable(call)
        connection = link.connection
        assert connection is not None
        name = await _topology.declare(connection, op, wait)
        self._topology.record(op)
        return name

    def _check_usable(self, call: str) -> None:
        if self._link.fatal is not None:
            raise self._link.fatal
        if not self._admission.accepting:
            raise PublisherClosed.refused(call)

    def stats(self) -> Stats:
        """Counters (published, confirmed, nacked, returned, rejected, republished, timed out,
        ...), the in-flight gauge and a confirm-latency summary."""
        # Safe from another thread (telemetry's metric reader): publishes the engine has not
        # taken yet (Pump.take) are counted here, not taken.
        pending = self._pump.pending
        count = len(pending)
        stats = self._supervisor.stats()
        if count and self._pump.pending is pending:
            return replace(
                stats, published=stats.published + count, in_flight=stats.in_flight + count
            )
        return stats

    # --- publishing --------------------------------------------------------------------------

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool | None = None,
        **properties: Any,
    ) -> Handle:
        """Send a message; ``await`` the call for its future (an asyncio future). This waits
        only while the in-flight window is full.

        The future's result is a :class:`Confirmation`, or it raises the :class:`PublishError`
        subclass that says what became of the message. Keyword properties are AMQP basic
        properties (``headers``, ``message_id``, ``content_type``, ``correlation_id``,
        ``expiration``, ``priority``, ...); ``delivery_mode`` defaults to 2 (persistent) and a
        ``message_id`` is generated when none is given. Raises :class:`InvalidMessage` naming
        the field for a message AMQP cannot carry (before anything is sent), and
        :class:`PublishTimeout` when no room frees up within ``publish_timeout``. Cancelling the
        future only means the caller stopped caring: the message stays tracked until the broker
        settles it.
        """
        # PublisherSurface.publish, _publish, Admission.admit and Pump.take in one coroutine
        # for the usual case (a coroutine and four calls less a message: docs/benchmarks.md),
        # their twin: anything else (a spool, no loop yet, publishes waiting for room, closed,
        # telemetry on, a full window) goes through _publish and the admission.
        entry = self._builder.message(exchange, routing_key, body, mandatory, properties)
        admission = self._admission
        if (
            type(entry) is not AsyncPublishFuture
            or self._room_waiters
            or admission.fatal is not None
            or not admission.accepting
            or admission.telemetry is not None
        ):
            return await self._publish(entry)
        pump = self._pump
        try:
            index = self._window.try_issue(entry.size)
            if index:
                try:  # Admission.admit's, for an interrupt (see there)
                    entry.index = index
                    pump.pending.append(entry)
                except BaseException:
                    admission.interrupted((entry,))
                    raise
                if not pump.accept_due:
                    pump.accept_soon()
                return entry
        except KeyboardInterrupt:
            pump.rewake()  # it may have cut the wake-up this owed the writer
            raise
        return await self._publish(entry)  # no room: wait for it there

    async def _publish(self, entry: AsyncEntry) -> Handle:
        pump = self._pump
        admission = self._admission
        if self._spooled is not None:
            if not self._link.started:
                await self.connect()
            if admission.fatal is not None or not admission.accepting:
                admission.check(entry)
            spooled = self._spooled.publish_now(entry, bool(self._room_waiters))
            if spooled is not None:
                return spooled
            return await self._spooled.publish(
                entry, admission.check, lambda: bool(self._room_waiters)
            )
        loop = self._loop
        if loop is None:  # not ready: connect (or wait for the first channel) first
            if not self._link.ready.is_set():
                await self.connect()
            admission.check(entry)  # (closed before it ever started, say)
            loop = self._link.loop
        if type(entry) is AsyncPublishFuture:  # its own future
            future: Handle = entry
        else:  # made before the loop was known, or with a spool
            entry.handle = future = loop.create_future()
        try:  # (free of cost on Python 3.11+ until something is raised)
            # first come, first served: behind those waiting for room, even if it would fit
            wake = NO_ROOM if self._room_waiters else admission.admit(entry)
            while wake is NO_ROOM:  # (once: the wait ends when it fits and its turn came)
                await self._wait_for_room(entry)
                wake = admission.admit(entry)
            if wake is not None:
                wake()
        except KeyboardInterrupt:
            pump.rewake()  # it may have cut the wake-up this owed the writer
            raise
        return future

    async def _publish_many(self, entries: list[AsyncEntry]) -> list[Handle]:
        if not entries:
            return []
        if self._spooled is not None:
            if not self._link.started:
                await self.connect()
            spooled = self._spooled
            check = self._admission.check
            queued = lambda: bool(self._room_waiters)  # noqa: E731
            return [await spooled.publish(entry, check, queued) for entry in entries]
        if not self._link.ready.is_set():
            await self.connect()
        loop = self._link.loop
        if type(entries[0]) is not AsyncPublishFuture:  # made before the loop was known
            for entry in entries:
                entry.handle = loop.create_future()
        many = self._admission.admit_many(entries)
        try:
            while not many.finished:
                step = many.step()
                if isinstance(step, Entry):
                    try:
                        await self._wait_for_room(step)
                    except PublishTimeout as exc:
                        many.give_up(exc)
                elif step is not None:
                    step()
        except KeyboardInterrupt:
            self._pump.rewake()  # it may have cut the wake-up a step owed
            raise
        timeout = many.timeout
        if timeout is not None:  # the window stayed full: the rest were not admitted
            for entry in many.unadmitted():
                future_of(entry).set_exception(timeout)
        return [future_of(entry) for entry in entries]

    async def publish_and_wait(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        mandatory: bool | None = None,
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
        if self._spooled is not None:  # what waits on disk counts too
            return await self._spooled.flush(timeout)
        loop = asyncio.get_running_loop()
        window = self._window
        barrier = window.barrier()
        flush = Flush(lambda: barrier.remaining, None if timeout is None else loop.time() + timeout)
        try:
            while (wait := flush.wait_for(loop.time())) != 0.0:
                waiter: asyncio.Future[None] = loop.create_future()
                barrier.waiter = waiter  # set by _resolve when the barrier clears
                await asyncio.wait({waiter}, timeout=wait)
        finally:
            window.end_barrier(barrier)
        return flush.left

    async def persist(self, timeout: float | None = None) -> int:
        """As :meth:`Publisher.persist <reliable_amqp.Publisher.persist>`: with a spool, wait
        until every message published so far is durable on disk; how many are not yet when
        ``timeout`` passes first."""
        if self._spooled is None:
            raise ConfigurationError("persist() needs a spool: AsyncPublisher(url, spool=DIR)")
        return await self._spooled.persist(timeout)

    async def _wait_for_room(self, entry: AsyncEntry) -> None:
        """Wait until ``entry`` fits in the window and its turn came: first come, first served
        (a publish that finds others waiting queues behind them even if it would fit; see
        Admission.waiting); PublishTimeout after ``publish_timeout``."""
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
                raise self._window.full_error(self.options.publish_timeout)
            self._admission.check(entry)
            if self._window.fits(entry.size):
                self._wake_room()  # more room may be left for the next in line
                return
            retry = True

    def _wake_room(self) -> None:
        free = self._window.free_slots()
        waiters = self._room_waiters
        while waiters and free > 0:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    def _on_end(self) -> None:
        """The link gave up or ended: publishes are refused with its fatal error, if any, and
        those waiting for room learn it now."""
        self._admission.fatal = self._link.fatal
        self._release_room_waiters()

    def _release_room_waiters(self) -> None:
        while self._room_waiters:
            waiter = self._room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # --- settling ----------------------------------------------------------------------------

    def _resolve(self, resolved: list[AsyncEntry]) -> None:
        if not resolved:
            return
        if self._telemetry is not None:  # before the futures: a span ends with its message
            self._telemetry.on_resolved(resolved)
        spool = self._spooled.spool.directory if self._spooled is not None else None
        for entry in resolved:
            future = entry.handle
            outcome = entry.raw_outcome
            if outcome is CONFIRMED:
                if future is None:
                    # its own future (AsyncPublishFuture): its Confirmation is built when
                    # asked (its result(), await, repr: _future.py)
                    future = entry
                    confirmation: object = CONFIRMED
                else:
                    # entry.outcome and new_confirmation(), inlined: its twin is
                    # Entry.outcome, kept in step by tests/core/test_engine_properties.py (the
                    # Confirmation's fields) and every awaited Confirmation in tests/async
                    confirmation = _new(Confirmation)
                    _set_confirmed_id(confirmation, entry.message_id)
                    _set_attempts(confirmation, entry.attempts)
                try:  # noqa: SIM105  (free until raised; contextlib.suppress is not)
                    future.set_result(confirmation)
                except InvalidStateError:  # the caller cancelled it; the message was settled
                    pass
                continue
            if future is None:  # its own future (AsyncPublishFuture)
                future = entry
            if not future.done():  # done: the caller cancelled it; the message was settled
                if isinstance(outcome, Confirmation):
                    future.set_result(outcome)
                elif isinstance(outcome, BaseException):
                    if spool is not None and isinstance(outcome, PublisherClosed):
                        outcome = outcome.kept_in_spool(spool)  # what the feed keeps there
                    future.set_exception(outcome)
                    if self._open.reported:  # counted in that report: not one log line each
                        future.exception()
        for barrier in self._window.release(resolved):
            waiter = barrier.waiter
            if isinstance(waiter, asyncio.Future) and not waiter.done():
                waiter.set_result(None)
        if self._room_waiters:
            self._wake_room()
        if self._spooled is not None:
            self._spooled.resolved(resolved)


def _discard_outcome(future: asyncio.Future[Confirmation]) -> None:
    if not future.cancelled():
        future.exception()
