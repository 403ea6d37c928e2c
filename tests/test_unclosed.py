"""A publisher its user forgot to close: nothing it was handed is lost without a word.

A script that ends without ``close()`` delivers what it published (the sync Publisher is closed
at interpreter exit, waiting ``exit_timeout``); what cannot be delivered in that time, what a
garbage-collected publisher leaves, and what an ``AsyncPublisher`` whose event loop stops under
it leaves, is reported: one WARNING with the count and what to call, and a ResourceWarning.
Every call on a closed publisher raises PublisherClosed, both publishers.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.fixtures import ProxyFactory
from reliable_amqp import AsyncPublisher, Publisher, PublisherClosed, RecoveryFailed, RetryPolicy
from support.broker import BrokerAdmin

# A close coroutine made and never awaited (a publisher finalized after its loop closed) is a
# bug here, not noise: the same as `python -W error::RuntimeWarning -m pytest` on this file.
pytestmark = [pytest.mark.broker, pytest.mark.filterwarnings("error::RuntimeWarning")]

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_script(
    tmp_path: Path, body: str, *args: str, stdin: str = "", timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``body`` as a script in a child interpreter; (its result, seconds it took)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    return done, time.monotonic() - started


def reliable_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that reliable-amqp wrote."""
    return [line for line in stderr.splitlines() if "reliable-amqp" in line]


def exit_reports(stderr: str) -> list[str]:
    """The lines reporting a publisher left open at exit (retries may be logged besides)."""
    return [line for line in reliable_lines(stderr) if "when the interpreter exited" in line]


# --- interpreter exit ------------------------------------------------------------------------


def test_a_script_that_forgets_close_delivers_everything(
    tmp_path: Path, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    done, _ = run_script(
        tmp_path,
        """
        import sys
        from reliable_amqp import Publisher

        publisher = Publisher(sys.argv[1])
        for i in range(10_000):
            publisher.publish("", sys.argv[2], b"message %d" % i)
        # no close(), no flush(): the script just ends
        """,
        amqp_url,
        queue,
    )
    assert done.returncode == 0, done.stderr
    assert reliable_lines(done.stderr) == []  # all delivered: nothing to report
    assert broker.count(queue) == 10_000


CUT_AT_EXIT = """
    import sys
    from reliable_amqp import Publisher

    url, queue, spool = sys.argv[1], sys.argv[2], sys.argv[3] or None
    publisher = Publisher(url, exit_timeout=2, spool=spool)
    if spool is None:
        publisher.connect()
    print("connected", flush=True)
    sys.stdin.readline()  # the broker is cut off now
    for i in range(1000):
        publisher.publish("", queue, b"message %d" % i)
    print("published", flush=True)
"""


def test_unconfirmed_at_exit_are_reported_within_the_grace(
    tmp_path: Path, amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CUT_AT_EXIT))
    child = subprocess.Popen(
        [sys.executable, str(script), proxy.url(), queue, ""],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline() == "connected\n"
    proxy.refuse()
    proxy.cut()
    started = time.monotonic()
    out, err = child.communicate("go\n", timeout=60)
    took = time.monotonic() - started
    print(f"exited {took:.1f} s after the cut (exit_timeout=2)")
    assert child.returncode == 0, err
    assert out == "published\n"
    assert took < 2 + 5
    lines = exit_reports(err)
    assert len(lines) == 1, err
    assert "1000 messages not confirmed" in lines[0]
    assert "still open when the interpreter exited" in lines[0]
    assert "PublisherClosed" in lines[0] and "close()" in lines[0]
    assert "guest:guest" not in err
    assert broker.count(queue) == 0


def test_with_a_spool_what_exit_leaves_goes_out_with_the_next_publisher(
    tmp_path: Path, amqp_url: str, broker: BrokerAdmin, make_proxy: ProxyFactory
) -> None:
    queue = broker.queue()
    spool = tmp_path / "spool"
    proxy = make_proxy()
    proxy.refuse()  # unreachable from the start: publish() goes to the spool meanwhile
    done, took = run_script(tmp_path, CUT_AT_EXIT, proxy.url(), queue, str(spool), stdin="go\n")
    print(f"the child took {took:.1f} s (exit_timeout=2)")
    assert done.returncode == 0, done.stderr
    lines = exit_reports(done.stderr)
    assert len(lines) == 1, done.stderr
    assert "1000 messages not confirmed" in lines[0]
    assert f"they stay in the spool {spool}" in lines[0]
    assert took < 2 + 5 + 5  # the child's own start-up and imports besides
    with Publisher(amqp_url, spool=str(spool)) as publisher:
        assert publisher.flush(timeout=60) == 0
    bodies = [body for _, body in broker.drain(queue)]
    assert bodies == [b"message %d" % i for i in range(1000)]


# --- garbage collection and a loop that stops ------------------------------------------------


@pytest.fixture
def reported(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """The WARNING records of the reliable_amqp logger, as text."""
    caplog.set_level(logging.WARNING, logger="reliable_amqp")

    def records() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "reliable_amqp" and r.levelno == logging.WARNING
        ]

    yield records


def test_a_collected_open_publisher_warns_with_the_count(
    broker: BrokerAdmin, make_proxy: ProxyFactory, reported: Callable[[], list[str]]
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    publisher = Publisher(proxy.url(), close_timeout=1)
    publisher.connect()
    proxy.stall()  # nothing gets through: nothing is confirmed
    futures = [publisher.publish("", queue, b"x") for _ in range(300)]
    with pytest.warns(ResourceWarning, match="garbage-collected while open"):
        del publisher
        gc.collect()
    (line,) = reported()
    assert "300 messages not confirmed" in line
    assert "close()" in line
    # closed in the background: after close_timeout, what is left fails (none is left pending)
    for future in futures:
        assert isinstance(future.exception(timeout=30), PublisherClosed)


def test_an_async_publisher_whose_loop_stops_warns_with_the_count(
    amqp_url: str, broker: BrokerAdmin, reported: Callable[[], list[str]]
) -> None:
    queue = broker.queue()
    futures: list[asyncio.Future[Any]] = []

    async def forgets_aclose() -> None:
        publisher = AsyncPublisher(amqp_url)
        await publisher.connect()
        futures.extend([await publisher.publish("", queue, b"x") for _ in range(500)])
        # returns without aclose(): asyncio.run() cancels the publisher's tasks

    with pytest.warns(ResourceWarning, match="before its event loop stopped"):
        asyncio.run(forgets_aclose())
    (line,) = reported()
    assert "500 messages not confirmed" in line
    assert "aclose()" in line
    assert all(isinstance(f.exception(), PublisherClosed) for f in futures)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # aiormq's own
def test_a_collected_open_async_publisher_warns_with_the_count(
    amqp_url: str, broker: BrokerAdmin, reported: Callable[[], list[str]]
) -> None:
    queue = broker.queue()
    loop = asyncio.new_event_loop()

    async def publishes() -> AsyncPublisher:
        publisher = AsyncPublisher(amqp_url)
        await publisher.connect()
        for _ in range(200):
            await publisher.publish("", queue, b"x")
        return publisher

    publisher = loop.run_until_complete(publishes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # asyncio's own: tasks destroyed while pending
        loop.close()  # under the open publisher, its tasks never to run again
    with pytest.warns(ResourceWarning, match="garbage-collected"):
        del publisher
        gc.collect()
    (line,) = reported()
    assert "200 messages not confirmed" in line


def test_a_closed_publisher_reports_nothing(
    amqp_url: str, broker: BrokerAdmin, reported: Callable[[], list[str]]
) -> None:
    queue = broker.queue()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with Publisher(amqp_url) as publisher:
            publisher.publish("", queue, b"x")
        del publisher

        async def closes() -> None:
            async with AsyncPublisher(amqp_url) as publisher:
                await publisher.publish("", queue, b"x")

        asyncio.run(closes())
        gc.collect()
    assert reported() == []
    assert broker.count(queue) == 2


def _collected_off_the_loop() -> list[str]:
    """Collect garbage in a thread of its own (as the collector may run in any thread, while an
    event loop runs in another); the warnings it raised."""
    caught: list[str] = []

    def collect() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            gc.collect()
        caught.extend(f"{w.category.__name__}: {w.message}" for w in seen)

    thread = threading.Thread(target=collect)
    thread.start()
    thread.join()
    return caught


def test_a_failed_async_with_reports_nothing_and_leaves_no_connection(
    make_proxy: ProxyFactory, reported: Callable[[], list[str]]
) -> None:
    """``async with AsyncPublisher(...)`` whose connect policy is spent raises RecoveryFailed,
    and that is all the user hears: no report of a publisher left open (no ``__aexit__``
    follows a failed ``__aenter__``; the user did use ``async with``), and none of the
    connections its attempts made is left to the garbage collector (aio-pika's finalizer of an
    open one schedules a close: off the loop's thread, a coroutine never awaited)."""
    dead = make_proxy()
    dead.refuse()
    policy = RetryPolicy(max_attempts=4, initial_delay=0.01, max_delay=0.02, jitter=0.0)

    async def fails() -> list[str]:
        gc.collect()
        gc.disable()  # what the attempts leave is collected below, in another thread
        try:
            with pytest.raises(RecoveryFailed):
                async with AsyncPublisher(dead.url(), connect_policy=policy):
                    raise AssertionError("connected through a refusing proxy")
            return _collected_off_the_loop()
        finally:
            gc.enable()

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        assert asyncio.run(fails()) == []
        gc.collect()
    assert dead.accepted_count >= 4
    assert not [line for line in reported() if "attempt" not in line], reported()


# --- every call on a closed publisher --------------------------------------------------------


def _closed_message(error: PublisherClosed, call: str) -> None:
    assert str(error).startswith(f"the publisher is closed: {call}"), str(error)
    assert "was not confirmed" not in str(error)


def test_every_call_on_a_closed_publisher_raises_publisher_closed(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()
    publisher = Publisher(amqp_url)
    with publisher:
        publisher.publish("", queue, b"x")
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("publish()", lambda: publisher.publish("", queue, b"y")),
        ("publish()", lambda: publisher.publish_many("", queue, [b"y"])),
        ("declaring", lambda: publisher.declare_queue(queue)),
        ("declaring", lambda: publisher.declare_exchange("x")),
        ("declaring", lambda: publisher.bind_queue(queue, "amq.direct")),
        ("connect()", publisher.connect),
        ("connect()", publisher.__enter__),
    ]
    for call, attempt in calls:
        with pytest.raises(PublisherClosed) as raised:
            attempt()
        _closed_message(raised.value, call)
    # a publisher closed before it ever connected too
    never = Publisher(amqp_url)
    never.close()
    with pytest.raises(PublisherClosed):
        never.publish("", queue, b"z")
    with pytest.raises(PublisherClosed):
        never.connect()
    assert broker.count(queue) == 1


def test_every_call_on_a_closed_async_publisher_raises_publisher_closed(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue()

    async def run() -> None:
        publisher = AsyncPublisher(amqp_url)
        async with publisher:
            await publisher.publish("", queue, b"x")
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("publish()", lambda: publisher.publish("", queue, b"y")),
            ("publish()", lambda: publisher.publish_many("", queue, [b"y"])),
            ("declaring", lambda: publisher.declare_queue(queue)),
            ("declaring", lambda: publisher.declare_exchange("x")),
            ("declaring", lambda: publisher.bind_queue(queue, "amq.direct")),
            ("connect()", publisher.connect),
            ("connect()", publisher.__aenter__),
        ]
        for call, attempt in calls:
            with pytest.raises(PublisherClosed) as raised:
                await attempt()
            _closed_message(raised.value, call)
        # close() is aclose() under aio-pika's name
        other = AsyncPublisher(amqp_url)
        await other.connect()
        assert await other.close() == 0
        with pytest.raises(PublisherClosed):
            await other.publish("", queue, b"z")

    asyncio.run(run())
    assert broker.count(queue) == 1
