"""The sync Publisher never hangs and never half-works: waits on its own I/O thread, fork(),
a publisher dropped without close(). Against the fake AMQP peer: no broker needed."""

from __future__ import annotations

import gc
import os
import threading
import time
from concurrent.futures import Future

import pytest

from adapters.conftest import DEFAULTS
from adapters.drivers import wait_until
from fake import FakeBroker
from reliable_amqp import (
    Confirmation,
    EventKind,
    Publisher,
    PublisherClosed,
    PublisherEvent,
    WouldDeadlock,
)

pytestmark = pytest.mark.timeout(60)


def test_result_in_a_done_callback_raises_instead_of_hanging(peer: FakeBroker) -> None:
    seen: list[BaseException | str] = []
    done = threading.Event()
    with Publisher(peer.url(), **DEFAULTS) as publisher:
        peer.set_auto(False)
        first = publisher.publish("", "q", b"first")
        second = publisher.publish("", "q", b"second")

        def on_first(future: Future[Confirmation]) -> None:
            # Runs on the I/O thread when `first` resolves; `second` is not resolved yet.
            try:
                second.result()  # no timeout: this would block the I/O thread for good
                seen.append("returned")
            except WouldDeadlock as exc:
                seen.append(exc)
            try:
                publisher.flush()
                seen.append("flushed")
            except WouldDeadlock as exc:
                seen.append(exc)
            try:
                publisher.publish_and_wait("", "q", b"third")
                seen.append("waited")
            except WouldDeadlock as exc:
                seen.append(exc)
            done.set()

        first.add_done_callback(on_first)
        wait_until(lambda: len(peer.pending()) == 2, what="both publishes at the peer")
        started = time.monotonic()
        peer.ack(peer.pending()[0])
        assert done.wait(5), "the callback never finished: the I/O thread hung"
        assert time.monotonic() - started < 2
        assert [type(x) for x in seen] == [WouldDeadlock] * 3
        assert "future.result() was called on the publisher's own I/O thread" in str(seen[0])
        assert "flush()" in str(seen[1])
        # The I/O thread is alive: it settles the rest (third was published, then waited on).
        peer.set_auto(True)
        for tag in peer.pending():
            peer.ack(tag)
        assert publisher.flush(timeout=5) == 0
        assert second.result(0).attempts == 1


def test_waiting_in_on_event_raises_instead_of_hanging() -> None:
    peer = FakeBroker().start()
    seen: list[str] = []
    holder: dict[str, Publisher] = {}

    def on_event(event: PublisherEvent) -> None:
        if event.kind is EventKind.CONNECTED:
            try:
                holder["p"].flush()
            except WouldDeadlock:
                seen.append("WouldDeadlock")

    try:
        publisher = Publisher(peer.url(), on_event=on_event, **DEFAULTS)
        holder["p"] = publisher
        with publisher:
            assert publisher.publish_and_wait("", "q", b"x").attempts == 1
        assert seen == ["WouldDeadlock"]
    finally:
        peer.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_publisher_inherited_through_fork_refuses_at_once_in_the_child(
    peer: FakeBroker,
) -> None:
    with Publisher(peer.url(), **DEFAULTS) as publisher:
        assert publisher.publish_and_wait("", "q", b"parent-before").attempts == 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what happened through the pipe, then leave at once
            code = "?"
            try:
                started = time.monotonic()
                try:
                    publisher.publish("", "q", b"child")
                    code = "published"
                except PublisherClosed as exc:
                    code = "closed" if "fork()" in str(exc) else f"closed-other:{exc}"
                if time.monotonic() - started > 1:
                    code += "-slow"
                code += f";flush={publisher.flush(timeout=10)}"
                code += f";close={publisher.close(timeout=10)}"
            except BaseException as exc:  # pragma: no cover - reported to the parent
                code = f"error:{exc!r}"
            finally:
                os.write(write, code.encode())
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        report = os.read(read, 1000).decode()
        os.close(read)
        assert os.waitstatus_to_exitcode(status) == 0
        assert report == "closed;flush=0;close=0"
        # The parent is unaffected.
        assert publisher.publish_and_wait("", "q", b"parent-after").attempts == 1
    assert [m.body for m in peer.received()] == [b"parent-before", b"parent-after"]


def _io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "reliable-amqp-io"]


def test_a_publisher_dropped_without_close_ends_its_thread_and_connection(
    peer: FakeBroker,
) -> None:
    before = len(_io_threads())
    publisher = Publisher(peer.url(), **DEFAULTS)
    publisher.connect()
    assert publisher.publish_and_wait("", "q", b"x").attempts == 1
    assert len(_io_threads()) == before + 1
    del publisher
    gc.collect()
    wait_until(lambda: len(_io_threads()) == before, 10, "the I/O thread to end")
    wait_until(lambda: not peer.live_connections(), 10, "the connection to close")
