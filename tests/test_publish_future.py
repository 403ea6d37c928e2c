"""PublishFuture behaves as a concurrent.futures.Future for every waiter and callback."""

from __future__ import annotations

import threading
import time
from concurrent.futures import (
    FIRST_COMPLETED,
    CancelledError,
    Future,
    InvalidStateError,
    as_completed,
    wait,
)
from typing import Any, cast

import pytest

from reliable_amqp._compat import futures as compat_futures
from reliable_amqp._core.builder import build_message
from reliable_amqp._core.errors import MessageNacked
from reliable_amqp._core.message import DEFAULT_BASE, Confirmation
from reliable_amqp._sync._future import PublishFuture, future_factory


def _made(condition: compat_futures.SharedLockCondition, n: int) -> list[PublishFuture]:
    """``n`` futures as a publisher makes them (each its message's entry), sharing
    ``condition``."""
    new = future_factory(condition, None)
    futures = [new("", "q", b"", DEFAULT_BASE, False, f"m-{i}") for i in range(n)]
    for i, future in enumerate(futures):
        future.index = i
    return futures


def _futures(n: int) -> list[PublishFuture]:
    return _made(compat_futures.SharedLockCondition(), n)


def _later(seconds: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_this_python_gets_the_light_future() -> None:
    # Fails when a Python release changes Future's fields: the fallback then is a plain Future
    # (correct, slower), and _compat/futures.py should learn the new layout.
    assert compat_futures.LIGHT_FUTURES
    # the same fields, but the lists of waiters and callbacks are made when first used
    lazy = {"_waiters": "_lazy_waiters", "_done_callbacks": "_lazy_callbacks"}
    expected = {lazy.get(name, name) for name in vars(Future())}
    # (and guard: the future is also the publisher's entry for its message, whose fields,
    # index among them, are slots)
    assert set(vars(_futures(1)[0])) == expected | {"guard"}


def test_futures_sharing_a_condition_resolve_in_one_go_and_skip_cancelled_ones() -> None:
    condition = compat_futures.SharedLockCondition()
    futures = _made(condition, 4)
    seen: list[object] = []
    futures[0].add_done_callback(lambda f: seen.append(f.result()))
    assert futures[2].cancel()
    error = MessageNacked(build_message("", "q", b"x"), 1)
    assert wait(futures[1:2], timeout=0).not_done  # makes (and empties) one's list of waiters
    compat_futures.resolve_futures(condition, futures[:3], [Confirmation("a", 1), error, error])
    assert seen == [Confirmation("a", 1)]
    assert futures[1].exception(timeout=0) is error
    assert futures[2].cancelled()
    assert not futures[3].done()
    with pytest.raises(TimeoutError):
        futures[3].result(timeout=0.05)


def test_result_waits_for_another_thread_to_set_it() -> None:
    future = _futures(1)[0]
    confirmation = Confirmation("id-1", 1)
    thread = _later(0.1, lambda: future.set_result(confirmation))
    started = time.monotonic()
    assert future.result(timeout=5) is confirmation
    assert time.monotonic() - started >= 0.05
    thread.join()


def test_result_timeout_raises_and_a_later_result_still_arrives() -> None:
    future = _futures(1)[0]
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    future.set_result(Confirmation("id", 1))
    assert future.result(timeout=0) == Confirmation("id", 1)


def test_exception_is_raised_by_result_and_returned_by_exception() -> None:
    future = _futures(1)[0]
    error = MessageNacked(build_message("", "q", b"x"), 1)
    thread = _later(0.05, lambda: future.set_exception(error))
    with pytest.raises(MessageNacked):
        future.result(timeout=5)
    assert future.exception(timeout=0) is error
    thread.join()


def test_waiting_on_one_future_is_not_woken_by_its_siblings() -> None:
    # They share a lock; a notify meant for one must not end another's wait early.
    first, second = _futures(2)
    thread = _later(0.05, lambda: second.set_result(Confirmation("b", 1)))
    with pytest.raises(TimeoutError):
        first.result(timeout=0.3)
    thread.join()


def test_many_threads_wait_on_many_futures() -> None:
    futures = _futures(200)
    got: list[str] = []
    got_lock = threading.Lock()

    def waiter(chunk: list[PublishFuture]) -> None:
        for f in chunk:
            value = f.result(timeout=10).message_id
            with got_lock:
                got.append(value)

    waiters = [threading.Thread(target=waiter, args=(futures[i::8],)) for i in range(8)]
    for t in waiters:
        t.start()
    for i, f in enumerate(futures):
        f.set_result(Confirmation(str(i), 1))
    for t in waiters:
        t.join()
    assert sorted(got, key=int) == [str(i) for i in range(200)]


def test_concurrent_futures_wait_and_as_completed() -> None:
    futures = _futures(50)
    # cast: the list of set_result()'s None values is discarded, which mypy cannot see
    setter = _later(
        0.05, lambda: [cast(Any, f).set_result(Confirmation(str(f.index), 1)) for f in futures]
    )
    done, not_done = wait(futures, timeout=5)
    assert len(done) == 50 and not not_done
    assert {f.result().message_id for f in as_completed(futures, timeout=1)} == {
        str(i) for i in range(50)
    }
    setter.join()
    pending = _futures(3)
    _later(0.05, lambda: pending[1].set_result(Confirmation("x", 1))).join()
    done, not_done = wait(pending, timeout=1, return_when=FIRST_COMPLETED)
    assert done == {pending[1]} and len(not_done) == 2


def test_callbacks_cancel_and_double_set() -> None:
    future, other = _futures(2)
    seen: list[object] = []
    future.add_done_callback(lambda f: seen.append(f.result()))
    future.set_result(Confirmation("a", 1))
    assert seen == [Confirmation("a", 1)]
    future.add_done_callback(lambda f: seen.append("late"))  # runs at once when already done
    assert seen[-1] == "late"
    with pytest.raises(InvalidStateError):
        future.set_result(Confirmation("again", 1))
    assert other.cancel()
    with pytest.raises(CancelledError):
        other.result(timeout=0)
    with pytest.raises(InvalidStateError):
        other.set_result(Confirmation("b", 1))
    assert repr(future).startswith("<PublishFuture at")
