"""Ctrl-C in a user's script that a sync ``Publisher`` blocks (issue 33).

First, the mechanism, deterministically: a ``KeyboardInterrupt`` that arrives while the caller's
thread waits for a lock the I/O thread holds is raised as soon as the wait ends. Behind a
Python-level ``__enter__`` (``threading.Condition``'s) that is after the lock was taken and
before the ``with`` block began, so nothing releases it: the I/O thread then blocks on it
forever. The publisher's locks must come out of it free.

A script blocked in ``flush()``, in ``publish()`` on a full in-flight window, or in ``close()``
gets SIGINT at a sweep of delays, with a core kept busy: the ``KeyboardInterrupt`` must reach
the script within 5 s wherever it lands, leave every future it was handed resolved (the ``with``
block closes the publisher within a second: the user asked to stop), and say what was not
confirmed once. The queue never confirms past two messages, so the script is always blocked.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker_support import BrokerAdmin
from reliable_amqp import Publisher
from reliable_amqp._compat.futures import LightFuture, SharedLockCondition


def _interrupted_while_waiting_for(lock: Any, call: Callable[[], object]) -> None:
    """Run ``call`` in this thread while another holds ``lock``; raise KeyboardInterrupt in this
    thread while it waits for that lock (as a Ctrl-C would), then let the lock go."""
    me = threading.get_ident()
    held = threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            time.sleep(0.2)  # this thread blocks on the lock meanwhile
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(me), ctypes.py_object(KeyboardInterrupt)
            )
            time.sleep(0.05)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        holder.join()


def _free(lock: Any) -> bool:
    """Whether another thread can take ``lock`` now."""
    got: list[bool] = []

    def take() -> None:
        got.append(lock.acquire(timeout=1))
        if got[0]:
            lock.release()

    taker = threading.Thread(target=take)
    taker.start()
    taker.join()
    return got[0]


def test_a_condition_over_the_lock_would_keep_it_after_the_interrupt() -> None:
    # what the sync publisher did before: the lock stays taken by the interrupted thread
    lock = threading.Lock()
    condition = threading.Condition(lock)
    _interrupted_while_waiting_for(lock, condition.__enter__)
    assert not _free(lock)
    lock.release()  # (held by this thread)


def test_the_futures_lock_is_free_after_an_interrupt() -> None:
    condition = SharedLockCondition()
    future: LightFuture[int] = LightFuture(condition)
    _interrupted_while_waiting_for(condition, lambda: future.add_done_callback(print))
    assert _free(condition)
    _interrupted_while_waiting_for(condition, lambda: future.result(5))
    assert _free(condition)


@pytest.mark.parametrize("call", ["flush", "close"])
def test_the_publishers_lock_is_free_after_an_interrupt(call: str) -> None:
    publisher = Publisher("amqp://guest:guest@127.0.0.1:1/%2F")  # never connects
    handoff = publisher._handoff
    _interrupted_while_waiting_for(handoff.lock, getattr(publisher, call))
    assert _free(handoff.lock)
    assert publisher.close() == 0


pytestmark = [pytest.mark.broker]

SCRIPT = """
    import sys
    from reliable_amqp import Publisher

    url, queue, where = sys.argv[1:]
    futures = []
    patient = {"max_attempts": 10_000, "initial_delay": 0.2, "max_delay": 0.2}
    window = 5 if where == "publish" else 1000
    try:
        with Publisher(url, nack_policy=patient, max_in_flight=window, close_timeout=60) as p:
            for i in range(20):
                futures.append(p.publish("", queue, b"%d" % i))  # blocks on the 6th: "publish"
            print("blocked", flush=True)
            if where == "flush":
                p.flush()
            elif where == "close":
                p.close()
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", len(futures), sum(f.done() for f in futures), flush=True)
"""


@pytest.fixture
def busy_core() -> Iterator[None]:
    """One core kept busy for the test's duration."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["flush", "publish", "close"])
def test_ctrl_c_reaches_a_script_blocked_in_the_publisher(
    amqp_url: str, broker: BrokerAdmin, busy_core: None, where: str
) -> None:
    for step in range(4):
        queue = broker.queue(x_max_length=2, x_overflow="reject-publish")
        process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SCRIPT), amqp_url, queue, where],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        if where != "publish":
            assert process.stdout.readline() == "blocked\n"
        else:  # blocked in publish() before it could say so: wait for its first messages
            while broker.count(queue) < 2:
                time.sleep(0.01)
        time.sleep(0.1 * step)
        process.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            pytest.fail(f"{where}, step {step}: still running 30 s after Ctrl-C\n{err}")
        took = time.monotonic() - signalled
        assert took < 5.0, f"{where}, step {step}: {took:.1f} s to exit\n{err}"
        [line] = out.splitlines()
        words = line.split()
        assert words[0] == "interrupted", err
        handed, resolved = int(words[1]), int(words[2])
        # on a full window, publish() took the 5 first, then 2 more as the queue confirmed 2
        assert handed == resolved == (7 if where == "publish" else 20), line
        # at most 2 confirmed; the others were not, and no exception tells the script that:
        # said once, in one line
        reported = [x for x in err.splitlines() if "closed by Ctrl-C" in x]
        assert len(reported) == 1, err
        prefix = f"reliable-amqp: Publisher [amqp://guest:***@{amqp_url.split('@')[1]}] was "
        text = reported[0].removeprefix(prefix)
        assert text in [
            f"closed by Ctrl-C (KeyboardInterrupt) with {n} messages not confirmed: they failed "
            "with PublisherClosed"
            for n in range(handed - 2, handed + 1)
        ], err
        assert "Future exception was never retrieved" not in err
