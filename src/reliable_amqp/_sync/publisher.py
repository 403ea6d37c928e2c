"""Publisher: streaming publisher confirms over pika, for threads.

pika objects are not thread-safe, so one I/O thread (:class:`IOThread`) owns the connection (a
``SelectConnection``) and the core :class:`Supervisor`. ``publish()`` validates the message on the
caller's thread, takes room in the in-flight window, appends to the outbox of the shared
:class:`Handoff` and wakes the I/O thread only when it is idle; the I/O thread writes messages in
batches and settles confirms as they arrive. Nothing here decides what a frame means: the core
does, and the handoff turns its resolutions into futures.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import TYPE_CHECKING, Any

from reliable_amqp._compat.futures import LightFuture
from reliable_amqp._core.admission import NO_ROOM
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import (
    ConfigurationError,
    OperationTimeout,
    PublisherClosed,
)
from reliable_amqp._core.message import Confirmation
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.supervisor import Supervisor
from reliable_amqp._core.topology import Topology, TopologyOp
from reliable_amqp._core.window import Flush
from reliable_amqp._logs import report_interrupted
from reliable_amqp._otel import TelemetrySlot
from reliable_amqp._surface import PublisherSurface
from reliable_amqp._sync._future import PublishFuture, future_factory
from reliable_amqp._sync._handoff import Handoff
from reliable_amqp._sync._io import IOThread
from reliable_amqp._sync._pika import connection_parameters
from reliable_amqp._sync._spooled import SpooledPublishing
from reliable_amqp._unclosed import report_unclosed

if TYPE_CHECKING:
    from reliable_amqp._otel._telemetry import Telemetry

# Publishers alive in this process: a forked child must not use the ones it inherited.
_live_handoffs: weakref.WeakSet[Handoff] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for handoff in list(_live_handoffs):
        handoff.forget_after_fork()
    _live_handoffs.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


#: how long a publisher closed at interpreter exit waits for its I/O thread to end, beyond
#: ``exit_timeout`` (a connection attempt under way ends at its next check of the stop flag)
_EXIT_JOIN = 3.0
#: how long a publisher whose ``with`` block Ctrl-C ended waits for confirms before it closes
INTERRUPTED_CLOSE = 1.0
#: Publishers connected and not closed: closed at interpreter exit (see _close_at_exit)
_open_publishers: weakref.WeakSet[Publisher] = weakref.WeakSet()


def _close_open_publishers() -> None:
    for publisher in list(_open_publishers):
        publisher._close_at_exit()


# The I/O threads are daemons, so they still run when atexit handlers do.
atexit.register(_close_open_publishers)


class _Parts:
    """What closing needs, without the Publisher object: the finalizer of a publisher that was
    garbage-collected holds this, not the publisher."""

    __slots__ = ("handoff", "io", "name", "options", "spooled", "supervisor", "telemetry")

    def __init__(
        self,
        handoff: Handoff,
        io: IOThread,
        supervisor: Supervisor[PublishFuture],
        *,
        spooled: SpooledPublishing | None,
        options: PublisherOptions,
        name: str,
    ) -> None:
        self.handoff = handoff
        self.io = io
        self.supervisor = supervisor
        self.spooled = spooled
        self.options = options
        self.name = name
        self.telemetry: Telemetry | None = None

    def flush(self, timeout: float | None) -> int:
        """:meth:`Publisher.flush`."""
        end = None if timeout is None else time.monotonic() + timeout
        handoff = self.handoff
        if handoff.forked:
            return handoff.window.count  # nothing will resolve them here
        handoff.check_wait("flush()")
        if self.spooled is not None:  # what waits on disk counts too
            return self.spooled.flush(timeout)
        window = handoff.window
        # Waits off the lock (see Handoff): a Ctrl-C here leaves nothing held. One that lands
        # between the barrier's start and the try leaves it counting until it reaches zero,
        # then the window drops it (Window.release).
        with handoff.lock:
            barrier = window.barrier()
        try:
            return handoff.wait_out(Flush(lambda: barrier.remaining, end))
        finally:
            with handoff.lock:
                window.end_barrier(barrier)

    def close(self, wait: float, join: float | None = None) -> int:
        """:meth:`Publisher.close`; ``join`` bounds the wait for the I/O thread to end after the
        flush (None: as long as it takes). Returns how many messages were not confirmed."""
        handoff = self.handoff
        handoff.check_wait("close()")
        with handoff.lock:
            handoff.accepting = False
            handoff.notify_all()
        if not self.io.started:
            if self.spooled is not None:
                self.spooled.close(wait)
            return 0
        try:
            left = self.flush(wait)
        except KeyboardInterrupt:
            # Ctrl-C while waiting for confirms: stop waiting, close now (what is unconfirmed
            # fails, or stays in the spool), say so once, and let the interrupt go on.
            handoff.closing_unclosed = True
            left = self._finish(wait, join, handoff.window.count)
            report_interrupted(self.name, left, self.options.spool)
            raise
        return self._finish(wait, join, left)

    def _finish(self, wait: float, join: float | None, left: int) -> int:
        """The rest of :meth:`close`, once the flush is over with ``left`` unconfirmed; returns
        how many closing failed (without a spool: confirms that arrive while the I/O thread
        stops count as confirmed, not as ``left`` said), or stayed in the spool (``left``)."""
        handoff = self.handoff
        closed_before = handoff.closed_unconfirmed  # (a second close fails nothing more)
        self.io.stop(wait=join is None)
        if join is not None and not self.io.join(join):
            return max(left, handoff.window.count)  # still stopping: the engine is its own
        # The I/O thread settled everything it held; a publish that raced close() may remain.
        # The thread is gone, so the engine is this thread's to finish.
        supervisor = self.supervisor
        supervisor.accept(handoff.pop_outbox() or (), time.monotonic())
        handoff.resolve_closing(supervisor.shutdown())
        if self.spooled is not None:  # what is left stays in the spool for the next publisher
            self.spooled.close(wait)
        if self.telemetry is not None:
            self.telemetry.close()
        return left if self.spooled is not None else handoff.closed_unconfirmed - closed_before


def _collected(parts: _Parts) -> None:
    """A connected Publisher was garbage-collected without close(): report what is still
    unconfirmed, and close it in the background as close() would (its futures may still be
    held; a finalizer must not block)."""
    if not parts.io.started or parts.io.stopping.is_set() or parts.handoff.forked:
        return
    wait = parts.options.close_timeout
    report_unclosed(
        f"{parts.name} was garbage-collected while open",
        parts.handoff.window.count,
        f"they get up to close_timeout={wait:g} s to be confirmed, in the background, then "
        "fail with PublisherClosed",
        parts.options.spool,
        "Call close() (or use `with Publisher(...)`) to wait for them and see their outcome.",
    )
    parts.handoff.closing_unclosed = True  # reported above: not once per future too
    threading.Thread(
        target=parts.close, args=(wait,), name="reliable-amqp-close", daemon=True
    ).start()


class Publisher(PublisherSurface[None, str, Future[Confirmation], list[Future[Confirmation]]]):
    """A confirming publisher over pika; share one between threads.

    ``Publisher(url, **options)`` takes a broker URL (or a list of URLs to fail over between) and
    the options of :class:`~reliable_amqp.PublisherOptions`. Use it as a context manager, or call
    :meth:`connect` and :meth:`close`.
    """

    def __init__(self, url: str | Sequence[str], **options: Any) -> None:
        self.options = PublisherOptions.create(url, **options)
        params = [connection_parameters(u, self.options) for u in self.options.urls]
        self._handoff = Handoff(self.options)
        self._window = self._handoff.window
        self._admission = self._handoff.admission
        #: set once the I/O thread opened its first channel (its event is never cleared)
        self._opened = False
        self._supervisor: Supervisor[PublishFuture] = Supervisor(self.options)
        #: checks and builds each message: as its own future (see PublishFuture)
        self._builder = self._init_builder(future_factory(self._handoff.futures, self._handoff))
        #: the durable spool's part (spool=DIR): opening it takes its lock, or raises
        self._spooled = (
            SpooledPublishing(self.options, self._handoff, self._supervisor.events)
            if self.options.spool is not None
            else None
        )
        self._handoff.spooled = self._spooled
        #: OpenTelemetry, decided at connect() (None: off; see docs/observability.md)
        self._otel = TelemetrySlot()
        self._telemetry: Telemetry | None = None
        self._io = IOThread(params, self._handoff, self._supervisor, Topology())
        _live_handoffs.add(self._handoff)
        urls = ", ".join(redact_url(u) for u in self.options.urls)
        self._parts = _Parts(
            self._handoff,
            self._io,
            self._supervisor,
            spooled=self._spooled,
            options=self.options,
            name=f"Publisher [{urls}]",
        )
        # Dropped without close(): the thread holds no reference to this object, so it can be
        # collected; then what is unconfirmed is reported and the publisher closed.
        self._finalizer = weakref.finalize(self, _collected, self._parts)
        self._finalizer.atexit = False  # at exit, _close_at_exit() closes it while still here

    # --- lifecycle ---------------------------------------------------------------------------

    def connect(self) -> Publisher:
        """Open the connection (retrying under ``connect_policy``); raise if that fails.

        Called by ``with`` and by the first ``publish()``. Wrong credentials raise
        :class:`AuthenticationFailed` at once; other failures raise :class:`RecoveryFailed` once
        the connect policy is spent.
        """
        handoff = self._handoff
        if handoff.fatal is not None:
            raise handoff.fatal
        if not handoff.accepting:
            raise PublisherClosed.refused("connect()")
        handoff.check_wait("connect()")
        self._telemetry = self._parts.telemetry = handoff.telemetry = self._otel.decide(
            self.options, self._supervisor, self.stats
        )
        self._admission.telemetry = self._telemetry
        _open_publishers.add(self)
        self._io.start()
        if self._spooled is not None:
            return self  # connects in the background; publish() goes to the spool meanwhile
        opened = self._io.opened
        while not opened.is_set():  # waits off the lock (see Handoff), looking 20 times a second
            with handoff.lock:
                if handoff.fatal is not None:
                    raise handoff.fatal
                if not handoff.accepting:
                    raise PublisherClosed.refused("connect()", reason="closed while connecting")
                waiter = handoff.waiter()
            handoff.wait(waiter, 0.05)
        return self

    def __enter__(self) -> Publisher:
        return self.connect()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self._close_interrupted()
        else:
            self.close()

    def _close_interrupted(self) -> None:
        """Ctrl-C ended the ``with`` block: close within :data:`INTERRUPTED_CLOSE` s (not
        ``close_timeout``: the user asked to stop), what is unconfirmed then reported once."""
        if self._handoff.forked:
            return
        self._finalizer.detach()
        _open_publishers.discard(self)
        parts = self._parts
        parts.handoff.closing_unclosed = True
        left = parts.close(min(INTERRUPTED_CLOSE, self.options.close_timeout))
        report_interrupted(parts.name, left, self.options.spool)

    def close(self, timeout: float | None = None) -> int:
        """Flush (up to ``timeout``, default ``close_timeout``), then close.

        Whatever is still unresolved then fails with :class:`PublisherClosed`: after ``close()``
        returns, every future this publisher handed out is resolved. Returns how many failed so.
        """
        if self._handoff.forked:  # the parent's thread and socket: leave them alone
            return self._window.count
        self._finalizer.detach()
        _open_publishers.discard(self)
        return self._parts.close(self.options.close_timeout if timeout is None else timeout)

    def _close_at_exit(self) -> None:
        """The interpreter is exiting and nobody closed this publisher: close it, waiting
        ``exit_timeout`` for what is unconfirmed (what is left is reported, not lost quietly)."""
        _open_publishers.discard(self)
        self._finalizer.detach()
        handoff = self._handoff
        if handoff.forked or not handoff.accepting:
            return
        wait = self.options.exit_timeout
        handoff.closing_unclosed = True  # reported below: not once per future too
        left = self._parts.close(wait, join=_EXIT_JOIN)
        if left:
            report_unclosed(
                f"{self._parts.name} was still open when the interpreter exited (it waited "
                f"exit_timeout={wait:g} s for confirms)",
                left,
                "they failed with PublisherClosed",
                self.options.spool,
                "Call close() (or flush()) before the program ends, or use `with Publisher(...)`.",
            )

    # --- topology ----------------------------------------------------------------------------

    def _declare(self, op: TopologyOp, timeout: float | None) -> Any:
        self._handoff.check_wait(f"declaring {op.describe()}")
        if not self._handoff.accepting and self._handoff.fatal is None:
            raise PublisherClosed.refused(f"declaring {op.describe()}")
        if not self._io.opened.is_set():
            self.connect()
        handoff = self._handoff
        # (a future over the publisher's own C lock: Ctrl-C-safe, as PublishFuture is)
        future: Future[Any] = LightFuture(handoff.futures)
        with handoff.lock:
            if handoff.fatal is not None:
                raise handoff.fatal
            if not handoff.accepting:
                raise PublisherClosed.refused(f"declaring {op.describe()}")
            handoff.requests.append((op, future))
        handoff.wake(force=True)
        wait = self.options.connect_timeout if timeout is None else timeout
        try:
            return future.result(wait)
        except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
            # Still queued (the broker unreachable): it will not be made later, behind the
            # caller's back. Already on its way, the broker's answer decides (and is kept).
            future.cancel()
            raise OperationTimeout(f"declaring {op.describe()} took over {wait:g} s") from None

    # --- publishing --------------------------------------------------------------------------

    def _publish(self, entry: PublishFuture) -> Future[Confirmation]:
        # The entry is its own future (see PublishFuture). Cancelling the future only means
        # the caller stopped caring: the message stays tracked.
        admission = self._admission
        if not self._opened:  # (the event's is_set() is a call a publish: it is set for good)
            if not self._io.opened.is_set():
                admission.check(entry)
                self.connect()
            self._opened = self._io.opened.is_set()
        try:  # (free of cost on Python 3.11+ until something is raised)
            if self._spooled is not None:
                return self._spooled.publish(entry, admission.check)
            with self._handoff.lock:
                wake = admission.admit(entry)
            if wake is not None:
                if wake is NO_ROOM:
                    return self._publish_when_room(entry)
                wake()
        except BaseException:
            self._handoff.interrupted()  # a Ctrl-C may have lost the wake-up this owed
            raise
        return entry

    def _publish_when_room(self, entry: PublishFuture) -> PublishFuture:
        """:meth:`_publish` into a full window: wait for room (off the lock: see Handoff), at
        most ``publish_timeout``."""
        handoff = self._handoff
        # A callback publishing into a full window would wait for confirms that only this (the
        # I/O) thread can read: fail at once instead.
        handoff.check_wait("publish() into a full in-flight window")
        end = time.monotonic() + self.options.publish_timeout
        while True:
            with handoff.lock:
                wake = self._admission.admit(entry)
                if wake is not NO_ROOM:
                    break
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise self._window.full_error(self.options.publish_timeout)
                waiter = handoff.waiter()
            handoff.wait(waiter, remaining)
        if wake is not None:
            wake()
        return entry

    def _publish_many(self, entries: list[PublishFuture]) -> list[Future[Confirmation]]:
        if not entries:
            return []
        admission = self._admission
        if not self._io.opened.is_set():
            admission.check(entries[0])
            self.connect()
        handoff = self._handoff
        try:
            if self._spooled is not None:
                return [self._spooled.publish(entry, admission.check) for entry in entries]
            self._admit_many(entries)
        except BaseException:
            handoff.interrupted()  # a Ctrl-C may have lost the wake-up a step owed
            raise
        return list(entries)

    def _admit_many(self, entries: list[PublishFuture]) -> None:
        """:meth:`_publish_many`'s admission: runs as the window takes them, waiting for room
        between them (off the lock: see Handoff) for up to ``publish_timeout``."""
        handoff = self._handoff
        many = self._admission.admit_many(entries)  # each step under the lock; waits off it
        end = 0.0  # publish_timeout's deadline, once the window is full
        while not many.finished:
            waiter = wake = None
            with handoff.lock:
                step = many.step()
                if isinstance(step, Entry):  # wait for room (see Handoff)
                    now = time.monotonic()
                    if not end:
                        handoff.check_wait("publish() into a full in-flight window")
                        end = now + self.options.publish_timeout
                    if now >= end:
                        many.give_up(self._window.full_error(self.options.publish_timeout))
                        continue
                    waiter = handoff.waiter()
                else:
                    end = 0.0
                    wake = step
            if waiter is not None:
                handoff.wait(waiter, end - time.monotonic())
            elif wake is not None:
                wake()
        for entry in many.unadmitted():  # the window stayed full: these were not admitted
            entry.set_exception(many.timeout)

    def publish_and_wait(
        self, exchange: str, routing_key: str, body: bytes, **options: Any
    ) -> Confirmation:
        """Publish one message and wait for its outcome (slow: prefer ``publish`` + ``flush``).

        ``options`` are :meth:`publish`'s keywords: ``mandatory`` and the message properties.
        """
        return self.publish(exchange, routing_key, body, **options).result()

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every message published so far is resolved; return how many are not.

        Messages published by other threads after this call started are not waited for.
        """
        return self._parts.flush(timeout)

    def persist(self, timeout: float | None = None) -> int:
        """With a spool: wait until every message published so far is durable on disk
        (committed, and fsynced unless ``spool_fsync="never"``): the commit point after which
        a crash of this process loses none of them. Returns how many are not durable yet when
        ``timeout`` passes first (0: all are). Raises :class:`SpoolError` when the spool cannot
        be written (a full disk), :class:`ConfigurationError` without a spool.
        """
        if self._spooled is None:
            raise ConfigurationError("persist() needs a spool: Publisher(url, spool=DIR)")
        return self._spooled.persist(timeout)
