"""PublishFuture: a ``concurrent.futures.Future`` that costs less to make than a plain one.

A plain ``Future()`` builds a ``threading.Condition`` (an RLock, a deque and six bound methods),
about a dozen objects the garbage collector then tracks for as long as the message is in flight.
At tens of thousands of publishes a second that was the largest single cost on the caller's
thread, and its collections the largest on the I/O thread.

A PublishFuture shares one lock with every other future of its publisher and makes a real
``Condition`` over it only when some thread actually waits on it (``result()`` before the
outcome is known). It is a ``Future`` in every other respect: ``concurrent.futures.wait``,
``as_completed``, callbacks and cancellation behave as they do on a plain one.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from reliable_amqp._core.message import Confirmation

# What Future.__init__ sets (the same from Python 3.8 to 3.13); if a later Python sets other
# fields, PublishFuture falls back to Future.__init__ and is merely a plain future.
_EXPECTED_FIELDS = {"_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks"}
_probe: Future[Any] = Future()
_LIGHT = set(vars(_probe)) == _EXPECTED_FIELDS
_PENDING = _probe._state
del _probe


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


class PublishFuture(Future[Confirmation]):
    """The future ``Publisher.publish()`` returns; ``index`` orders it for ``flush()``."""

    __slots__ = ("index",)

    def __init__(self, lock: threading.RLock, index: int) -> None:
        if _LIGHT:
            # Future.__init__, with the shared-lock condition in place of a new Condition.
            self._condition = SharedLockCondition(lock)  # type: ignore[assignment]
            self._state = _PENDING
            self._result = None
            self._exception = None
            self._waiters: list[Any] = []
            self._done_callbacks: list[Any] = []
        else:  # pragma: no cover - a Python whose Future has other fields
            super().__init__()
        self.index = index
