"""A ``KeyboardInterrupt`` at every point of a sync publisher's calls leaks and delays nothing
(issue 33).

A Ctrl-C is raised in the main thread where the interpreter checks for signals: since Python
3.11, at the entry of a Python function and after a call to a C function returns (and at a
loop's back edge). ``sys.setprofile`` reports exactly those points to a function of the
caller's thread ("call" and "c_return"), and an exception raised there comes out of the call as
a real Ctrl-C would. So each test runs one call of the publisher again and again, raising a
``KeyboardInterrupt`` at its 1st point, then its 2nd, ..., until the call completes with none
left, and after each interrupt checks the publisher is whole:

- no room of the in-flight window was kept by a message that never went out: ``flush()``
  returns 0 and the window holds nothing (an interrupt between counting a message and handing
  it to the I/O thread once kept its room for good: ``flush()`` never returned);
- nothing waits for a wake-up that was lost: the next publish is confirmed without a timer to
  rescue it (``heartbeat=0``; an interrupt between handing a message over and waking the I/O
  thread once left every later publish waiting);
- a message interrupted after it was handed over still goes out: the queue holds every message
  whose ``publish()`` returned, and at most the interrupted ones besides.

(On Python 3.10 the interpreter checks for signals between almost any two instructions; these
points are the 3.11+ ones, which the library's hand-over is built to survive.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import aio_pika
import aiormq
import pika
import pytest

import reliable_amqp
from reliable_amqp import AsyncPublisher, Publisher, PublisherClosed
from support.broker import BrokerAdmin

pytestmark = [pytest.mark.broker]

#: a publisher for the sweep: no heartbeat (no timer of the I/O thread's can make up for a
#: lost wake-up) and patient flushes (a flush that times out here is a defect, not a slow run)
FLUSH = 10.0


#: the code a sweep interrupts: the library's, the AMQP clients' it calls in the caller's
#: thread, and this module's (the call under test)
SWEPT = (
    *(os.path.dirname(m.__file__ or "") + os.sep for m in (reliable_amqp, pika, aiormq, aio_pika)),
    __file__,
)
#: the standard library (threading's locks and events, collections...): swept where the code
#: above calls it, never where pytest, coverage or a plugin does
STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def under_test(frame: FrameType | None) -> bool:
    """Whether a profile event in ``frame`` belongs to the call under test: the frame runs
    :data:`SWEPT` code, or the standard library's on behalf of the nearest caller that does.
    Not pytest's, coverage's or a plugin's (a finalizer of theirs run by the garbage collector
    in the middle of the call, an import hook compiling a module), nor the import machinery's:
    an interrupt there is no Ctrl-C the library could meet in a user's program, and pytest's
    and coverage's own state is not built to survive one."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(SWEPT):
            return True
        if not filename.startswith(STDLIB) or "site-packages" in filename:
            return False  # (pytest, coverage, plugins, "<frozen importlib._bootstrap>"...)
        frame = frame.f_back
    return False


def _raise_at(
    point: int, counted: Callable[[FrameType], bool] = under_test
) -> Callable[[FrameType, str, Any], None]:
    """A profile function (``sys.setprofile``) that raises ``KeyboardInterrupt`` at the
    ``point``-th point (1-based) where the interpreter would take a signal, among the frames
    ``counted`` admits (by default those :func:`under_test`)."""
    seen = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal seen
        if event in {"call", "c_return"} and counted(frame):
            seen += 1
            if seen == point:
                sys.setprofile(None)
                where = getattr(arg, "__qualname__", "") if event == "c_return" else ""
                raise KeyboardInterrupt(
                    f"point {point}: {event} {where} in {frame.f_code.co_name}, "
                    f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
                )

    return profile


def _interrupted(call: Callable[[], Any], point: int) -> str:
    """Run ``call``, raising ``KeyboardInterrupt`` at its ``point``-th point (see
    :func:`_raise_at`); where it was raised, or "" if ``call`` ended first."""
    sys.setprofile(_raise_at(point))
    try:
        call()
    except KeyboardInterrupt as interrupt:
        return str(interrupt)
    finally:
        sys.setprofile(None)
    return ""


@pytest.fixture
def url(amqp_url: str) -> str:
    return amqp_url + ("&" if "?" in amqp_url else "?") + "heartbeat=0"


def _sweep(publisher: Publisher, call: Callable[[], Any], queue: str) -> Iterator[int]:
    """Interrupt ``call`` at each of its points in turn; after each, check the publisher is
    whole (see the module docstring). Yields each point interrupted."""
    point = 0
    while True:
        point += 1
        assert point < 5_000, "the call never completed uninterrupted"
        where = _interrupted(call, point)
        if not where:
            return
        # the next publish goes out without a timer's help, and nothing is left counted
        after = publisher.publish("", queue, b"after")
        left = publisher.flush(FLUSH)
        assert left == 0, f"{where}: flush() left {left} (window {_window(publisher)})"
        assert after.done() and after.exception() is None
        assert _window(publisher) == (0, 0), where
        yield point


def _window(publisher: Publisher) -> tuple[int, int]:
    window = publisher._handoff.window
    return window.count, window.bytes


def test_an_interrupt_anywhere_in_publish_leaks_and_delays_nothing(
    url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    returned = 0
    with Publisher(url) as publisher:

        def publish() -> None:
            nonlocal returned
            publisher.publish("", queue, b"swept")
            returned += 1

        points = list(_sweep(publisher, publish, queue))
        assert publisher.flush(FLUSH) == 0
    assert len(points) > 10
    # each point's "after" message, the uninterrupted last publish, and those interrupted ones
    # that were already handed over
    count = broker.count(queue)
    assert len(points) + 1 <= count <= 2 * len(points) + 1, (count, len(points))
    assert returned == 1


def test_an_interrupt_anywhere_in_a_spooled_publish_leaks_and_delays_nothing(
    url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    # spool=DIR: the message is appended to the spool and issued in the window in one step
    # (SpoolFeed.append_direct), then handed to the I/O thread as without a spool
    queue = broker.queue()
    with Publisher(url, spool=str(tmp_path / "spool")) as publisher:
        points = list(_sweep(publisher, lambda: publisher.publish("", queue, b"s"), queue))
    assert len(points) > 10
    # every message went out: none was left behind on disk (each point's "after", the last
    # publish, and the interrupted ones the spool had taken)
    assert len(points) + 1 <= broker.count(queue) <= 2 * len(points) + 1


def test_an_interrupt_anywhere_in_publish_into_a_full_window_leaks_nothing(
    url: str, broker: BrokerAdmin
) -> None:
    # the window full: publish() waits for room, then admits (its slow path)
    queue = broker.queue()
    with Publisher(url, max_in_flight=1) as publisher:

        def publish_behind_one() -> None:
            publisher.publish("", queue, b"first")
            publisher.publish("", queue, b"second")  # waits for the first's confirm

        points = list(_sweep(publisher, publish_behind_one, queue))
    assert len(points) > 10


def test_an_interrupt_anywhere_in_publish_many_leaks_and_delays_nothing(
    url: str, broker: BrokerAdmin
) -> None:
    # three messages into a window of two: a run admitted, a wait for room, the rest admitted
    queue = broker.queue()
    with Publisher(url, max_in_flight=2) as publisher:
        points = list(
            _sweep(
                publisher,
                lambda: publisher.publish_many("", queue, [b"m0", b"m1", b"m2"]),
                queue,
            )
        )
    assert len(points) > 10


def test_an_interrupt_anywhere_in_flush_leaves_no_barrier_behind(
    url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    with Publisher(url) as publisher:

        def publish_and_flush() -> None:
            publisher.publish("", queue, b"flushed")
            publisher.flush(FLUSH)

        points = list(_sweep(publisher, publish_and_flush, queue))
        # a flush left behind by an interrupt would go on counting every later confirm
        assert publisher._handoff.window._barriers == []
    assert len(points) > 10


def test_an_interrupt_anywhere_in_close_reports_exactly_what_failed(
    url: str, broker: BrokerAdmin, caplog: pytest.LogCaptureFixture
) -> None:
    # Ctrl-C in close() closes at once and says, in one WARNING, how many messages were not
    # confirmed; confirms that arrive while the I/O thread stops are not among them (the count
    # was once taken before the stop, and said more than failed)
    queue = broker.queue()
    point = 0
    reports = 0
    while True:
        point += 1
        assert point < 5_000, "close() never completed uninterrupted"
        publisher = Publisher(url, close_timeout=FLUSH).connect()
        futures = [publisher.publish("", queue, b"c%d" % i) for i in range(50)]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="reliable_amqp"):
            interrupted = _interrupted(publisher.close, point)
            publisher.close()  # (an interrupt before close() began its work left it open)
        failed = sum(isinstance(f.exception(0), PublisherClosed) for f in futures)
        said = [r.getMessage() for r in caplog.records if "closed by Ctrl-C" in r.getMessage()]
        counts = [int(m.split(" with ")[1].split()[0]) for m in said]
        assert sum(counts) == failed, f"point {point}: said {said}, {failed} failed"
        assert len(said) <= 1
        reports += len(said)
        if not interrupted:
            break
    assert point > 10


def test_an_interrupt_anywhere_in_the_async_publishers_code_leaks_and_delays_nothing(
    url: str, broker: BrokerAdmin
) -> None:
    # The same sweep over AsyncPublisher.publish(), at the points in the library's code and
    # the client's, not inside asyncio's own: a KeyboardInterrupt inside Future.set_result()
    # (between marking it done and scheduling its callbacks) leaves the task awaiting it asleep
    # for good, which no library can repair (asyncio.run turns the first Ctrl-C into a
    # cancellation for that reason).
    queue = broker.queue()

    async def main() -> int:
        points = 0
        me = asyncio.current_task()
        async with AsyncPublisher(url) as publisher:
            await publisher.flush()
            while True:
                points += 1
                assert points < 5_000, "publish() never completed uninterrupted"
                # the points of this task's publish() (not the loop's, nor other tasks')
                sys.setprofile(
                    _raise_at(
                        points,
                        lambda frame: (
                            asyncio.current_task() is me
                            and "asyncio" not in frame.f_code.co_filename
                            and frame.f_code.co_filename != __file__
                            and under_test(frame)
                        ),
                    )
                )
                try:
                    swept = await publisher.publish("", queue, b"swept")
                except KeyboardInterrupt as interrupt:
                    where = str(interrupt)
                else:
                    sys.setprofile(None)
                    await swept
                    return points
                finally:
                    sys.setprofile(None)
                after = await publisher.publish("", queue, b"after")
                left = await publisher.flush(FLUSH)
                window = publisher._window
                assert left == 0, f"{where}: flush() left {left}"
                assert after.done() and after.exception() is None
                assert (window.count, window.bytes) == (0, 0), where

    # (9 points on Python 3.11: the usual case is one coroutine, AsyncPublisher.publish)
    assert asyncio.run(main()) > 5
