"""PublishFuture: the cheaper ``concurrent.futures.Future`` that ``Publisher.publish()`` returns.

The machinery (CPython ``Future`` fields, the shared-lock condition) is in
:mod:`reliable_amqp._compat.futures`, where it is probed at import.
"""

from __future__ import annotations

import threading
from typing import Protocol

from reliable_amqp._compat.futures import LIGHT_FUTURES, LightFuture, SharedLockCondition
from reliable_amqp._core.message import Confirmation

__all__ = ["PublishFuture", "SharedLockCondition", "WaitGuard"]

#: kept for callers of the old name: True when PublishFuture is the light kind
_LIGHT = LIGHT_FUTURES


class WaitGuard(Protocol):
    """Says whether a thread may block on a publisher's future (see :class:`Handoff`)."""

    def check_wait(self, what: str) -> None:
        """Raise when waiting here could never end (on the publisher's own I/O thread)."""


class PublishFuture(LightFuture[Confirmation]):
    """The future ``Publisher.publish()`` returns; ``index`` orders it for ``flush()``.

    Waiting for it (``result()``, ``exception()``) on the publisher's own I/O thread, say in a
    done-callback, raises at once: only that thread can resolve it.
    """

    __slots__ = ("guard", "index")

    def __init__(
        self,
        condition: SharedLockCondition | threading.RLock,
        index: int,
        guard: WaitGuard | None = None,
    ) -> None:
        if type(condition) is not SharedLockCondition:
            # a lock of its own (tests); publishers pass the condition their futures share
            condition = SharedLockCondition(condition)  # type: ignore[arg-type]
        LightFuture.__init__(self, condition)
        self.index = index
        self.guard = guard

    def result(self, timeout: float | None = None) -> Confirmation:
        """The :class:`Confirmation`, or raise what became of the message."""
        guard = self.guard
        if guard is not None and not self.done():
            guard.check_wait("future.result()")
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What became of the message (None when it was confirmed)."""
        guard = self.guard
        if guard is not None and not self.done():
            guard.check_wait("future.exception()")
        return super().exception(timeout)
