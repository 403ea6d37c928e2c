"""One blocking driver interface over both publishers, for tests that run against each, and the
helpers those tests share.

``Publisher`` already has it; :class:`BlockingAsync` (``tests/support/aio_blocking.py``, which the
broker contract suite uses too) serves an :class:`AsyncPublisher` on an event loop thread of its
own behind the same methods. It uses the public API only, so it keeps working while the adapters'
internals change.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from reliable_amqp import Confirmation

T = TypeVar("T")


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "it") -> None:
    """Poll ``predicate`` until it holds; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def outcomes(
    futures: Sequence[concurrent.futures.Future[Confirmation]], timeout: float = 10
) -> list[str]:
    """The outcome class name of each future, in order (each must resolve within ``timeout``)."""
    names = []
    for f in futures:
        exc = f.exception(timeout)
        names.append("Confirmation" if exc is None else type(exc).__name__)
    return names
