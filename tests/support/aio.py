"""Helpers for the async tests: run coroutine tests without pytest-asyncio, count outcomes.

``@aio`` turns ``async def test_x(fixture, ...)`` into a plain test that pytest can call: the
coroutine runs in a fresh event loop (``asyncio.run``) under a time limit, so a hang fails the
test instead of the run. A shared, parametrized suite can use the same ``@aio`` to drive either
publisher through one driver interface (see docs/async.md, "Testing").
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from reliable_amqp import Confirmation

T = TypeVar("T")

#: seconds one async test may run before it is failed
TEST_LIMIT = 120.0


def aio(
    test: Callable[..., Coroutine[Any, Any, None]],
) -> Callable[..., None]:
    """Run an ``async def`` test in its own event loop (pytest sees the same signature)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), TEST_LIMIT))

    return run


async def outcomes(
    futures: Iterable[asyncio.Future[Confirmation]], timeout: float = 30
) -> dict[str, int]:
    """Count futures by outcome class name; every future must resolve within ``timeout``."""
    futures = list(futures)
    if futures:
        _, pending = await asyncio.wait(futures, timeout=timeout)
        assert not pending, f"{len(pending)} futures unresolved after {timeout} s"
    counts: dict[str, int] = {}
    for f in futures:
        exc = f.exception()
        name = "Confirmation" if exc is None else type(exc).__name__
        counts[name] = counts.get(name, 0) + 1
    return counts


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking helper (BrokerAdmin, the proxy) without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
