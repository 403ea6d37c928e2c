"""A ``concurrent.futures.Future`` that costs less to make, by setting CPython's private fields.

A plain ``Future()`` builds a ``threading.Condition`` (an RLock, a deque and six bound methods),
about a dozen objects the garbage collector then tracks for as long as the message is in flight.
At tens of thousands of publishes a second that was the largest single cost on the caller's
thread, and its collections the largest on the I/O thread.

A :class:`LightFuture` shares one lock with its siblings and makes a real ``Condition`` over it
only when some thread actually waits on it (``result()`` before the outcome is known). It is a
``Future`` in every other respect: ``concurrent.futures.wait``, ``as_completed``, callbacks and
cancellation behave as they do on a plain one.

The hook is ``Future.__init__``'s set of fields, probed at import. Unlike pika's and aiormq's
hooks, a mismatch is not an error: a new Python must not make the library unimportable. The
fallback is a plain ``Future`` (correct, slower), visible as :data:`LIGHT_FUTURES` being False,
which the test suite asserts is True on every supported Python.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

__all__ = ["LIGHT_FUTURES", "LightFuture", "SharedLockCondition", "probe", "resolve_futures"]

T = TypeVar("T")

#: what ``Future.__init__`` sets, the same from Python 3.8 to 3.13
EXPECTED_FIELDS = frozenset(
    {"_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"}
)


def probe(future_class: type[Future[Any]] = Future) -> bool:
    """True when a new ``future_class()`` has exactly the fields :class:`LightFuture` sets.

    The argument lets tests probe a stand-in class.
    """
    try:
        fields = set(vars(future_class()))
    except Exception:  # a Future without a __dict__, or one that needs arguments
        return False
    return fields == EXPECTED_FIELDS


#: False on a Python whose Future sets other fields: LightFuture is then a plain Future
LIGHT_FUTURES = probe()


def _states() -> tuple[str, str, str]:
    pending: Future[None] = Future()
    running: Future[None] = Future()
    running.set_running_or_notify_cancel()
    finished: Future[None] = Future()
    finished.set_result(None)
    return pending._state, running._state, finished._state


_PENDING, _RUNNING, _FINISHED = _states()
_NOT_DONE = (_PENDING, _RUNNING)


class SharedLockCondition(_thread.RLock):  # type: ignore[misc]
    """The part of ``threading.Condition`` a Future uses, over one lock many futures share: the
    object is that lock (a C ``RLock``), so ``with future._condition`` takes and releases it in C.

    A Python ``__enter__``/``__exit__`` around the lock (``threading.Condition``'s) can be
    interrupted by a ``KeyboardInterrupt`` between taking the lock and returning, or before
    releasing it: the lock then stays held by the interrupted thread, and the publisher's I/O
    thread, which settles futures under it, blocks forever. A C lock's own ``with`` cannot be
    left so.

    Every method is called with the lock held (Future's own code does so), so creating the real
    Condition on the first ``wait`` cannot race with a ``notify_all``. :class:`LightFuture`
    waits without it (:meth:`waiter`): the Condition is left for Future's own code.
    """

    __slots__ = ("_condition", "_waiters")

    def __init__(self) -> None:
        self._condition: threading.Condition | None = None
        #: threads waiting on a future of this lock, off the lock (LightFuture._wait_done)
        self._waiters: list[threading.Lock] = []

    def waiter(self) -> threading.Lock:
        """Under the lock: a lock to wait on, off the lock, until the next notify."""
        waiter = threading.Lock()
        waiter.acquire()
        self._waiters.append(waiter)
        return waiter

    def forget(self, waiter: threading.Lock) -> None:
        """Under the lock: ``waiter`` timed out (it is no longer waited on)."""
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a notify, as ``Condition.wait`` does (the lock is released meanwhile)."""
        if self._condition is None:
            self._condition = threading.Condition(self)
        return self._condition.wait(timeout)

    def notify(self, n: int = 1) -> None:
        """Wake threads waiting on a future of this lock (all: a wake-up may be meant for a
        sibling, and each waiter looks again)."""
        self.notify_all()

    def notify_all(self) -> None:
        """Wake every thread waiting on a future of this lock."""
        if self._waiters:
            for waiter in self._waiters:
                waiter.release()
            self._waiters = []
        if self._condition is not None:
            self._condition.notify_all()


class LightFuture(Future[T]):
    """A ``Future`` whose condition is a :class:`SharedLockCondition` shared with its siblings.

    Its lists of waiters and callbacks are made only when something is put in them (most
    futures never have either), so a future is one object for the garbage collector to track,
    not four. The condition being shared, a wake-up may be meant for a sibling: ``result()`` and
    ``exception()`` wait in a loop until this future is done or the timeout is spent.
    """

    def __init__(self, condition: SharedLockCondition) -> None:
        self.init_light(condition)

    def init_light(self, condition: SharedLockCondition) -> None:
        """What ``__init__`` does (for an object made without calling it)."""
        if LIGHT_FUTURES:
            # Future.__init__, with the shared condition and the lists left for later.
            self._condition = condition  # type: ignore[assignment]
            self._state = _PENDING
            self._result = None
            self._exception = None
            self._lazy_waiters: list[Any] | None = None
            self._lazy_callbacks: list[Any] | None = None
        else:  # pragma: no cover - a Python whose Future has other fields
            self._lazy_waiters = None
            self._lazy_callbacks = None
            Future.__init__(self)

    @property
    def _waiters(self) -> list[Any]:
        waiters = self._lazy_waiters
        if waiters is None:
            waiters = self._lazy_waiters = []
        return waiters

    @_waiters.setter
    def _waiters(self, value: list[Any]) -> None:
        self._lazy_waiters = value

    @property
    def _done_callbacks(self) -> list[Any]:
        callbacks = self._lazy_callbacks
        if callbacks is None:
            callbacks = self._lazy_callbacks = []
        return callbacks

    @_done_callbacks.setter
    def _done_callbacks(self, value: list[Any]) -> None:
        self._lazy_callbacks = value

    def _wait_done(self, timeout: float | None) -> None:
        """Wait until done or ``timeout`` is spent, on a waiter of the shared lock and off that
        lock (see :class:`SharedLockCondition`: a Ctrl-C meanwhile leaves nothing held)."""
        end = None if timeout is None else time.monotonic() + timeout
        condition = self._condition
        if not isinstance(condition, SharedLockCondition):  # pragma: no cover - a plain Future
            with condition:
                if self._state in _NOT_DONE:
                    condition.wait(timeout)
            return
        while True:
            with condition:
                if self._state not in _NOT_DONE:
                    return
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return
                waiter = condition.waiter()
            if remaining is None:
                waiter.acquire()
            elif not waiter.acquire(True, min(remaining, 1e9)):
                with condition:
                    condition.forget(waiter)

    def result(self, timeout: float | None = None) -> T:
        """As ``Future.result``."""
        if self._state is not _FINISHED:
            self._wait_done(timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As ``Future.exception``."""
        if self._state is not _FINISHED:
            self._wait_done(timeout)
        return super().exception(0)


def resolve_futures(
    condition: SharedLockCondition,
    futures: Iterable[LightFuture[Any]],
    outcomes: Iterable[Any],
    on_exception: Callable[[Any, BaseException], None] | None = None,
) -> None:
    """Resolve many futures that share ``condition`` with their ``outcomes`` (in the same
    order): a result, or an exception instance, which is set as the exception.

    What ``set_result``/``set_exception`` do for each, under one taking of the shared lock and
    one notify; a future that is already done (cancelled by its caller) is left as it is. A
    fast-path twin of CPython's ``Future.set_result``/``set_exception`` (which LightFuture
    inherits, and which the loop below for other Pythons calls): change it with them. Kept in
    step by tests/test_publish_future.py: test_this_python_gets_the_light_future (the fields
    written here are CPython's) and
    test_futures_sharing_a_condition_resolve_in_one_go_and_skip_cancelled_ones.
    Callbacks run after the lock is released, as a plain Future runs them. ``on_exception``
    is called for each future set with an exception, before any callback runs (nothing is
    done per future that gets a result).
    """
    pairs = zip(futures, outcomes, strict=True)
    if not LIGHT_FUTURES:  # pragma: no cover - a Python whose Future has other fields
        for future, outcome in pairs:
            try:
                if isinstance(outcome, BaseException):
                    if on_exception is not None and not future.done():
                        on_exception(future, outcome)
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            except InvalidStateError:
                pass
        return
    with_callbacks: list[LightFuture[Any]] = []
    with condition:
        for future, outcome in pairs:
            if future._state not in _NOT_DONE:
                continue
            if isinstance(outcome, BaseException):
                future._exception = outcome
                future._state = _FINISHED
                if on_exception is not None:
                    on_exception(future, outcome)
                waiters = future._lazy_waiters
                if waiters:
                    for waiter in waiters:
                        waiter.add_exception(future)
            else:
                future._result = outcome
                future._state = _FINISHED
                waiters = future._lazy_waiters
                if waiters:
                    for waiter in waiters:
                        waiter.add_result(future)
            if future._lazy_callbacks:
                with_callbacks.append(future)
        condition.notify_all()
    for future in with_callbacks:
        future._invoke_callbacks()  # type: ignore[attr-defined]


def watched(future: LightFuture[Any]) -> bool:
    """Whether ``future`` has done-callbacks or waiters (``concurrent.futures.wait``): someone
    will look at it, though nothing else may reference it."""
    if LIGHT_FUTURES:  # the lists are made only when something is put in them
        return bool(future._lazy_callbacks or future._lazy_waiters)
    return bool(future._done_callbacks or future._waiters)  # pragma: no cover


def watched_async(future: asyncio.Future[Any]) -> bool:
    """Whether an asyncio future has done-callbacks (an awaiting task adds one); True when
    this Python's futures do not say (then nothing is taken for unwatched)."""
    return bool(getattr(future, "_callbacks", True))
