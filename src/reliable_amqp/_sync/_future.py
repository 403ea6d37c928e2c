"""PublishFuture: the cheaper ``concurrent.futures.Future`` that ``Publisher.publish()`` returns.

The machinery (CPython ``Future`` fields, the shared-lock condition) is in
:mod:`reliable_amqp._compat.futures`, where it is probed at import.
"""

from __future__ import annotations

import threading

from reliable_amqp._compat.futures import LIGHT_FUTURES, LightFuture, SharedLockCondition
from reliable_amqp._core.message import Confirmation

__all__ = ["PublishFuture", "SharedLockCondition"]

#: kept for callers of the old name: True when PublishFuture is the light kind
_LIGHT = LIGHT_FUTURES


class PublishFuture(LightFuture[Confirmation]):
    """The future ``Publisher.publish()`` returns; ``index`` orders it for ``flush()``."""

    __slots__ = ("index",)

    def __init__(self, lock: threading.RLock, index: int) -> None:
        LightFuture.__init__(self, lock)
        self.index = index
