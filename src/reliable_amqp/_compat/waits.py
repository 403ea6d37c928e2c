"""Bounded waits on the event loop that never lose a cancellation, on every supported Python.

Before Python 3.12, ``asyncio.wait_for`` loses the cancellation of the task awaiting it when
the awaited thing completes in the same turn of the loop as the cancellation: it returns the
result and the task goes on as if never cancelled (CPython gh-86296; fixed in 3.12, where
``wait_for`` is built on ``asyncio.timeout``). In a loop that waits again and again (the
outbox relay waiting for rows, a consumer waiting to subscribe again) that turns
``task.cancel()`` into a task that never ends: the async relay's cancellation test hung about
one run in ten on 3.11.

:func:`wait_for` is ``asyncio.wait_for`` on 3.12 and later, and on 3.10 and 3.11 the same
contract built on ``asyncio.wait``, which lets a cancellation through: the result, or
``asyncio.TimeoutError`` once ``timeout`` passed (the awaitable cancelled then, and waited for),
or the task's own ``CancelledError`` (the awaitable cancelled too).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["cancel_requested", "wait_for", "wait_set"]

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable`` for at most ``timeout`` seconds (None: no bound), as
    ``asyncio.wait_for``, and a cancellation of the caller is never lost (see the module)."""
    if sys.version_info >= (3, 12):
        return await asyncio.wait_for(awaitable, timeout)
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except BaseException:  # cancelled while waiting: what it waited for goes too
        task.cancel()
        raise
    if done:
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # its cancellation ran (as asyncio.wait_for waits for it)
    if task.cancelled():
        raise asyncio.TimeoutError
    return task.result()  # it ended as it was being cancelled: its result (or error) stands


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set, for at most ``timeout`` seconds: whether it was set."""
    if event.is_set():
        return True
    try:
        await wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


def cancel_requested() -> bool | None:
    """Whether the running task was asked to cancel: ``Task.cancelling()`` on 3.11 and later;
    None on 3.10, which cannot tell.

    aiormq fails the RPCs of a connection it closes (a watchdog's drop, a close) with
    ``asyncio.CancelledError`` raised as an error, not as a cancellation of the awaiting task:
    this tells the two apart where Python can."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return None if cancelling is None else cancelling() > 0
