"""``_compat.waits``: bounded waits on the event loop that never lose the caller's cancellation.

Before Python 3.12, ``asyncio.wait_for`` returns the result when the awaited thing completes in
the same turn of the loop as the caller's cancellation, and the caller goes on uncancelled: the
async outbox relay's ``task.cancel()`` then hung about one run in ten (its wait for rows is an
``Event`` a publish confirm sets). These run on every leg of the suite (3.10 to 3.14)."""

from __future__ import annotations

import asyncio

import pytest

from reliable_amqp._compat.waits import cancel_requested, wait_for, wait_set


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_cancellation_in_the_turn_the_event_is_set_is_not_lost() -> None:
    async def main() -> None:
        event = asyncio.Event()
        waiter = asyncio.create_task(wait_set(event, 10))
        await _turns()
        event.set()
        waiter.cancel()  # the same turn: asyncio.wait_for on 3.10/3.11 returned True here
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert waiter.cancelled()

    asyncio.run(main())


def test_a_cancellation_in_the_turn_the_awaited_future_resolves_is_not_lost() -> None:
    async def main() -> None:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(wait_for(future, 10))
        await _turns()
        future.set_result(1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())


def test_the_result_the_timeout_and_the_awaitables_error() -> None:
    async def fails() -> None:
        raise ValueError("inner")

    async def main() -> None:
        event = asyncio.Event()
        assert await wait_set(event, 0.01) is False
        event.set()
        assert await wait_set(event, 0.01) is True
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.set_result, 7)
        assert await wait_for(future, 5) == 7
        slow = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(slow, 0.01)
        assert slow.cancelled()  # cancelled on the timeout, and waited for
        with pytest.raises(ValueError, match="inner"):
            await wait_for(fails(), 5)
        assert await wait_for(asyncio.sleep(0, "done"), None) == "done"

    asyncio.run(main())


def test_a_cancelled_caller_cancels_what_it_waited_for() -> None:
    async def main() -> None:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        waiter = asyncio.create_task(wait_for(inner, 10))
        await _turns()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await _turns()
        assert inner.cancelled()

    asyncio.run(main())


def test_cancel_requested_tells_a_raised_cancelled_error_from_a_cancellation() -> None:
    """aiormq fails the RPCs of a connection it closed with a raised CancelledError; the
    publisher's link treats that as a lost connection only when its task was not cancelled."""
    import sys

    seen: list[bool | None] = []

    async def body() -> None:
        try:
            raise asyncio.CancelledError  # raised as an error, as aiormq does
        except asyncio.CancelledError:
            seen.append(cancel_requested())
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # this task's own cancellation
            seen.append(cancel_requested())
            raise

    async def main() -> None:
        task = asyncio.create_task(body())
        await _turns()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ([None, None] if sys.version_info < (3, 11) else [False, True])
