"""What the caller's threads and the I/O thread share, under one lock.

Callers put messages in the outbox and take room in the window; the I/O thread takes the outbox,
settles futures and frees room. Everything here is guarded by ``lock``; the engine and the pika
objects are not here: only the I/O thread touches those.

A caller that waits (for room in the window, for a flush, for the spool to keep pace) never waits
while it holds ``lock``: it takes a waiter (:meth:`Handoff.waiter`) under the lock, leaves the
``with`` block, and waits on that waiter alone (:meth:`Handoff.wait`), which the next
:meth:`Handoff.notify_all` releases. That keeps Ctrl-C safe: a ``KeyboardInterrupt`` can be raised
at any point of the caller's code, and a ``threading.Condition`` over the lock (Python code that
releases and takes it again) could be left holding it, or having released it twice, by one
raised at the wrong moment; then the I/O thread, or the ``close()`` that follows, would block
forever. A ``with`` block on the C lock itself releases it however it is left.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from reliable_amqp._compat.futures import LightFuture, SharedLockCondition, resolve_futures
from reliable_amqp._core.admission import Admission
from reliable_amqp._core.errors import (
    PublisherClosed,
    PublisherForked,
    PublishError,
    ReliableAmqpError,
    WouldDeadlock,
)
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.window import Flush, Window
from reliable_amqp._sync._future import PublishFuture, retrieved
from reliable_amqp._sync._future import failed as report_if_unretrieved
from reliable_amqp._sync._topology import Request

if TYPE_CHECKING:
    from types import FrameType

    from reliable_amqp._otel._telemetry import Telemetry


class Backlog(Protocol):
    """What settles along with the window: the durable spool's bookkeeping (``spool=DIR``,
    :class:`~reliable_amqp._sync._spooled.SpooledPublishing`)."""

    def refill(self) -> list[PublishFuture]:
        """On the I/O thread: the messages waiting on disk that the window has room for now."""
        ...

    def resolved_locked(self, resolved: list[PublishFuture]) -> list[PublishError]:
        """Under :attr:`Handoff.lock`: note the resolved entries; returns the recovered
        messages that failed for good (to report once the lock is released)."""
        ...

    def after_resolved(self, failed: list[PublishError]) -> None:
        """After :meth:`resolved_locked`, off the lock: report ``failed``, read more back."""
        ...

    @property
    def directory(self) -> str:
        """The spool's directory (what a ``PublisherClosed`` names)."""
        ...


class Wakeup:
    """A wake-up the caller's threads give and the I/O thread waits for (between connections),
    Ctrl-C-safe where ``threading.Event`` is not: its ``set()`` takes a Condition's lock in
    Python code, so a ``KeyboardInterrupt`` raised just after the lock was taken leaves it held,
    and the next ``set()`` or ``wait()`` blocks forever. Here a wake-up is one C call, a C
    lock's release (a binary semaphore: wake-ups given while one waits are one wake-up)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held: no wake-up given yet

    def set(self) -> None:
        """Give the wake-up (once given, more are the same one until it is taken)."""
        with contextlib.suppress(RuntimeError):  # given already (the lock is free)
            self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a wake-up, and take it; True if one came."""
        return self._lock.acquire(True, min(max(0.0, timeout), 1e9))


class Flag:
    """A flag set once from any thread and read from any (:attr:`IOThread.stopping`): a plain
    attribute, where ``threading.Event.set()`` could be left holding its lock by a Ctrl-C
    (see :class:`Wakeup`)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        """Set the flag (for good)."""
        self._set = True

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set


class Handoff:
    """The shared state of one sync publisher (see the module docstring)."""

    def __init__(self, options: PublisherOptions) -> None:
        self.lock = threading.Lock()
        #: the waiters of callers waiting for a change (see the module docstring)
        self._waiters: list[threading.Lock] = []
        self.window = Window(options.max_in_flight, options.max_in_flight_bytes)
        #: whether a publish goes in now (the core's; every call under :attr:`lock`)
        #: (an interrupted admission gives its room back unless the outbox took the message)
        self.admission: Admission[PublishFuture] = Admission(
            self.window, self.hand_over, self.hand_over_run, took=self.took
        )
        self.outbox: deque[PublishFuture] = deque()
        self.requests: deque[Request] = deque()
        #: the condition (over one lock) this publisher's futures share
        self.futures = SharedLockCondition()
        #: set while a wake-up of the I/O thread is on its way (publishers need not send more)
        self.wake_pending = False
        #: how to wake the I/O thread while its loop runs (None: it is between connections)
        self.wake_loop: Callable[[], None] | None = None
        #: wakes the I/O thread while it waits between connections
        self.idle = Wakeup()
        #: the I/O thread's ident: waiting on a future there would deadlock
        self.io_ident: int | None = None
        #: the process this publisher belongs to (a forked child inherits a copy, not the thread)
        self.pid = os.getpid()
        #: the durable spool's part (``spool=DIR``), else None
        self.spooled: Backlog | None = None
        #: OpenTelemetry (set at connect; None: off)
        self.telemetry: Telemetry | None = None
        #: set when the publisher closes at interpreter exit or after it was dropped: what it
        #: fails then is reported in one line (report_unclosed), not once per future
        self.closing_unclosed = False
        #: how many messages closing failed with ``PublisherClosed`` (:meth:`resolve_closing`)
        self.closed_unconfirmed = 0

    @property
    def accepting(self) -> bool:
        """Under :attr:`lock`: False once the publisher closes (the admission's)."""
        return self.admission.accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self.admission.accepting = value

    @property
    def fatal(self) -> ReliableAmqpError | None:
        """Why the publisher gave up for good (the admission's), or None."""
        return self.admission.fatal

    @fatal.setter
    def fatal(self, value: ReliableAmqpError | None) -> None:
        self.admission.fatal = value

    def waiter(self) -> threading.Lock:
        """Under :attr:`lock`: a waiter for the next :meth:`notify_all`, to :meth:`wait` on once
        the lock is released."""
        waiter = threading.Lock()
        waiter.acquire()
        self._waiters.append(waiter)
        return waiter

    def wait(self, waiter: threading.Lock, timeout: float | None) -> None:
        """Off :attr:`lock`: wait until ``waiter``'s :meth:`notify_all` or ``timeout`` s."""
        if waiter.acquire(True, -1 if timeout is None else min(max(0.0, timeout), 1e9)):
            return
        with self.lock, contextlib.suppress(ValueError):
            self._waiters.remove(waiter)  # timed out: not notified

    def wait_out(self, flush: Flush, poll: float | None = None) -> int:
        """Wait until ``flush`` is over, looking under :attr:`lock` and waiting off it (at
        least every ``poll`` s, if given); how many of its messages are left unresolved."""
        while True:
            with self.lock:
                wait = flush.wait_for(time.monotonic())
                if wait == 0.0:
                    return flush.left
                waiter = self.waiter()
            if poll is not None and (wait is None or wait > poll):
                wait = poll
            self.wait(waiter, wait)

    def notify_all(self) -> None:
        """Under :attr:`lock`: wake every caller waiting for a change."""
        waiters = self._waiters
        if waiters:
            for waiter in waiters:
                waiter.release()
            self._waiters = []

    def wake(self, force: bool = False) -> None:
        """Make the I/O thread look at the outbox and its requests (``force``: even when a
        wake is on its way, for a request that must not wait for the next publish)."""
        with self.lock:
            if force:
                self.wake_pending = False
            wake = self.wake_call()
        if wake is not None:
            wake()

    def wake_call(self) -> Callable[[], None] | None:
        """Under :attr:`lock`, after adding to the outbox: the call that wakes the I/O thread,
        to make once the lock is released; None when a wake is on its way already (one wake
        however many publishes ask: the I/O thread takes the whole outbox). Between
        connections it wakes the thread's wait, which takes the outbox too (so a message's
        delivery deadline runs from its publish). :meth:`hand_over` inlines it: change both."""
        if self.wake_pending:
            return None
        self.wake_pending = True
        wake = self.wake_loop
        return self.idle.set if wake is None else wake

    def hand_over(self, entry: PublishFuture) -> Callable[[], None] | None:
        """Under :attr:`lock`: the admission's hand-over (an admitted entry to the outbox, for
        the I/O thread); the wake-up to make once the lock is released (see
        :meth:`wake_call`)."""
        self.outbox.append(entry)
        # wake_call(), inlined (one call less a publish): its twin, kept in step by
        # tests/adapters (every publish waits on the wake-up this gives)
        if self.wake_pending:
            return None
        self.wake_pending = True
        wake = self.wake_loop
        return self.idle.set if wake is None else wake

    def hand_over_run(self, entries: Sequence[PublishFuture]) -> Callable[[], None] | None:
        """:meth:`hand_over` for a run of entries, in order (publish_many)."""
        self.outbox.extend(entries)
        return self.wake_call()

    def took(self, entry: PublishFuture) -> bool:
        """Under :attr:`lock`, in an admission an interrupt ended: whether the hand-over put
        ``entry`` in the outbox (last) before it was raised."""
        outbox = self.outbox
        return bool(outbox) and outbox[-1] is entry

    def interrupted(self) -> None:
        """Off :attr:`lock`: a publish was interrupted (Ctrl-C) where the wake-up it owed the I/O
        thread may be lost (between the hand-over and the wake-up, or inside it), with the "on
        its way" flag set, which keeps every later publish from waking the thread: wake it
        again if the outbox holds anything. (Read off the lock: what this thread put there is
        either still there or taken by the I/O thread, which needs no wake-up then.)"""
        if self.outbox:
            self.wake(force=True)

    def pop_outbox(self) -> deque[PublishFuture] | None:
        """Everything published since the last call (None when nothing was)."""
        with self.lock:
            self.wake_pending = False
            if not self.outbox:
                return None
            items = self.outbox
            self.outbox = deque()
            return items

    def pop_requests(self) -> list[Request]:
        """The declarations callers asked for since the last call."""
        with self.lock:
            requests = list(self.requests)
            self.requests.clear()
            return requests

    def resolve(self, resolved: list[PublishFuture]) -> None:
        """Settle the futures the engine resolved (each its message's entry) and free their
        room in the window."""
        if not resolved:
            return
        if self.telemetry is not None:  # before the futures: a span ends with its message
            self.telemetry.on_resolved(resolved)
        # a future the caller cancelled is left as it is; the message was still settled. A
        # confirmed one keeps its raw outcome (CONFIRMED: the Confirmation is built by
        # future.result(), if anyone asks).
        # A failed one nobody retrieves is reported when it is collected (_future.failed).
        outcomes = [e.raw_outcome for e in resolved]
        resolve_futures(self.futures, resolved, outcomes, report_if_unretrieved)
        spooled = self.spooled
        with self.lock:  # held briefly: publishing threads wait on this lock
            self.window.release(resolved)
            failed = spooled.resolved_locked(resolved) if spooled is not None else None
            self.notify_all()
        if spooled is not None:
            spooled.after_resolved(failed or [])

    def resolve_closing(self, resolved: list[PublishFuture]) -> None:
        """:meth:`resolve` for what closing fails with ``PublisherClosed``: with a spool, the
        error says the message stays there; closed at exit or after being dropped, the
        publisher reports them in one line (:attr:`closing_unclosed`), not once each."""
        if not resolved:
            return
        self.closed_unconfirmed += len(resolved)
        spooled = self.spooled
        if spooled is not None:
            for entry in resolved:
                error = entry.raw_outcome
                if isinstance(error, PublisherClosed):
                    entry.raw_outcome = error.kept_in_spool(spooled.directory)
        self.resolve(resolved)
        if self.closing_unclosed:
            for future in resolved:
                retrieved(future)

    def fail(self, fatal: ReliableAmqpError) -> None:
        """The publisher gave up: callers waiting for room or a connection learn it now."""
        with self.lock:
            self.fatal = fatal
            self.notify_all()

    def on_io_thread(self) -> bool:
        """True when called from the I/O thread (where waiting on a future deadlocks)."""
        return threading.get_ident() == self.io_ident

    def check_wait(self, what: str) -> None:
        """Raise :class:`WouldDeadlock` when ``what`` (a blocking call) runs on the I/O thread:
        a done-callback or an ``on_event`` hook runs there, and only that thread can settle
        the messages it would wait for."""
        if threading.get_ident() == self.io_ident:
            raise WouldDeadlock(
                f"{what} was called on the publisher's own I/O thread (in a future's "
                "done-callback or the on_event hook), where it could never return: only this "
                "thread settles messages. Wait from another thread, or use add_done_callback."
            )

    @property
    def forked(self) -> bool:
        """True in a child process that inherited this publisher through ``fork()``."""
        return os.getpid() != self.pid

    def forget_after_fork(self) -> None:
        """In a forked child: the I/O thread did not come along, so nothing here can be sent
        or settled. Every call fails at once instead of waiting for a thread that is not there.
        """
        # The lock may have been held by a parent thread at fork(): take a fresh one.
        self.lock = threading.Lock()
        self._waiters = []
        self.futures = SharedLockCondition()
        self.accepting = False
        self.wake_loop = None
        self.fatal = PublisherForked(
            f"this publisher was made in process {self.pid} and cannot be used in the child "
            f"process {os.getpid()} that fork() made (its I/O thread and connection stay with "
            "the parent): create a new Publisher in the child"
        )


#: the code of the waits where a caller's thread holds nothing of a sync publisher's (see
#: :func:`safe_to_interrupt`)
_WAITS = frozenset({Handoff.wait.__code__, LightFuture._wait_done.__code__})


def safe_to_interrupt(frame: FrameType | None) -> bool:
    """Whether ``frame``, where a signal handler found the main thread, is one of the waits of a
    sync publisher (for room, a flush, a connection, a confirm, a declaration): a
    ``KeyboardInterrupt`` raised there ends the wait and leaves the publisher as it was (the
    command line raises one only there while it hands messages over)."""
    return frame is not None and frame.f_code in _WAITS
