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

import threading
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["LIGHT_FUTURES", "LightFuture", "SharedLockCondition", "probe"]

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
_PENDING = Future()._state


class SharedLockCondition:
    """The part of ``threading.Condition`` a Future uses, over a lock shared by many futures.

    Every method is called with the shared lock held (Future's own code does so), so creating
    the real Condition on the first ``wait`` cannot race with a ``notify_all``.
    """

    __slots__ = ("_condition", "_lock")

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._condition: threading.Condition | None = None

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the shared lock (``concurrent.futures.wait`` takes each future's)."""
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        """Release the shared lock."""
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a notify, as ``Condition.wait`` does (the shared lock is released)."""
        if self._condition is None:
            self._condition = threading.Condition(self._lock)
        return self._condition.wait(timeout)

    def notify(self, n: int = 1) -> None:
        """Wake up to ``n`` threads waiting on this future."""
        if self._condition is not None:
            self._condition.notify(n)

    def notify_all(self) -> None:
        """Wake every thread waiting on this future."""
        if self._condition is not None:
            self._condition.notify_all()


class LightFuture(Future[T]):
    """A ``Future`` whose condition is a :class:`SharedLockCondition` over ``lock``."""

    def __init__(self, lock: threading.RLock) -> None:
        if LIGHT_FUTURES:
            # Future.__init__, with the shared-lock condition in place of a new Condition.
            self._condition = SharedLockCondition(lock)  # type: ignore[assignment]
            self._state = _PENDING
            self._result = None
            self._exception = None
            self._waiters: list[Any] = []
            self._done_callbacks: list[Any] = []
        else:  # pragma: no cover - a Python whose Future has other fields
            super().__init__()
