"""Both publishers with ``spool=DIR``, against the real broker.

The broker is made unreachable with a TCP proxy in front of it that refuses connections
(``harness.proxy.TcpProxy.refuse``), then reachable again (``accept``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.proxy import TcpProxy
from reliable_amqp import (
    ConfigurationError,
    EventKind,
    MessageRejected,
    Publisher,
    PublisherClosed,
    PublisherEvent,
    PublishTimeout,
)
from reliable_amqp._core.builder import build_message
from reliable_amqp._spool import Spool, failed_entries, inspect
from reliable_amqp._spool._feed import PRUNE_MIN
from support.broker import BrokerAdmin, unique
from support.spool import Kind, SpooledAsync

pytestmark = pytest.mark.broker


def ids(broker: BrokerAdmin, queue: str) -> list[str]:
    return [props.message_id for props, _ in broker.drain(queue)]


def test_confirmed_messages_leave_the_spool(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    with kind(amqp_url, spool=tmp_path / "s") as publisher:
        futures = [
            publisher.publish("", queue, b"%d" % i, message_id=f"m-{i}") for i in range(3000)
        ]
        assert publisher.flush(30) == 0
        assert publisher.persist(10) == 0
    assert all(f.result().message_id == f"m-{i}" for i, f in enumerate(futures))
    assert ids(broker, queue) == [f"m-{i}" for i in range(3000)]
    summary = inspect(tmp_path / "s")
    assert (summary.pending, summary.failed, summary.in_use_by) == (0, 0, None)


def test_an_unreachable_broker_neither_blocks_publish_nor_loses_anything(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    queue = broker.queue()
    proxy.refuse()
    publisher = kind(proxy.url(), spool=tmp_path / "s", max_in_flight=100)
    started = time.monotonic()
    futures = [publisher.publish("", queue, b"%d" % i, message_id=f"m-{i}") for i in range(2000)]
    assert time.monotonic() - started < 10  # 20 windows' worth: no wait for the broker
    assert publisher.persist(10) == 0
    assert publisher.close(timeout=0.5) > 0
    for future in futures:  # every future resolved: the messages stay in the spool
        error = future.exception(5)
        assert isinstance(error, PublisherClosed)
    assert "stays in the spool" in str(futures[-1].exception())
    assert inspect(tmp_path / "s").pending == 2000
    # a new publisher, the broker reachable: the recovered messages first, in order, same ids
    proxy.accept()
    with kind(proxy.url(), spool=tmp_path / "s") as publisher:
        new = publisher.publish("", queue, b"new", message_id="new")
        assert publisher.flush(30) == 0
    assert new.result(1).message_id == "new"  # confirmed, not failed
    assert ids(broker, queue) == [f"m-{i}" for i in range(2000)] + ["new"]
    assert inspect(tmp_path / "s").pending == 0


def test_the_backlog_goes_out_in_order_once_the_broker_is_back(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    queue = broker.queue()
    proxy.refuse()
    with kind(proxy.url(), spool=tmp_path / "s", max_in_flight=50) as publisher:
        futures = [
            publisher.publish("", queue, b"%d" % i, message_id=f"m-{i}") for i in range(1000)
        ]
        assert publisher.flush(0.5) == 1000
        proxy.accept()  # the same publisher reconnects and reads the backlog back
        assert publisher.flush(60) == 0
    assert [f.result(5).message_id for f in futures] == [f"m-{i}" for i in range(1000)]
    assert ids(broker, queue) == [f"m-{i}" for i in range(1000)]


def test_recovered_failures_go_to_the_failed_table_and_are_reported(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    missing = unique("no-such-exchange")
    spool = Spool(tmp_path / "s")
    for i in range(20):
        exchange = missing if i == 7 else ""
        spool.append(build_message(exchange, queue, b"%d" % i, properties={"message_id": f"m-{i}"}))
    spool.close()
    events: list[PublisherEvent] = []
    with kind(amqp_url, spool=tmp_path / "s", on_event=events.append) as publisher:
        own = publisher.publish(missing, queue, b"own", message_id="own")
        assert publisher.flush(30) == 0
    assert isinstance(own.exception(), MessageRejected)  # the caller holds it: not kept
    # the channel the 404 closed had others in flight: republished, so duplicates may come
    assert list(dict.fromkeys(ids(broker, queue))) == [f"m-{i}" for i in range(20) if i != 7]
    failed = list(failed_entries(tmp_path / "s"))
    assert [f.message.message_id for f in failed] == ["m-7"]
    assert "MessageRejected" in failed[0].reason and "404" in failed[0].reason
    reported = [e for e in events if e.kind is EventKind.SPOOL_FAILED]
    assert len(reported) == 1
    assert isinstance(reported[0].error, MessageRejected)
    assert reported[0].error.message.message_id == "m-7"
    assert inspect(tmp_path / "s").pending == 0


def test_a_full_spool_makes_publish_wait_then_raise(
    kind: Kind, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    proxy.refuse()
    with kind(
        proxy.url(), spool=tmp_path / "s", spool_max_bytes=20_000, publish_timeout=0.5
    ) as publisher:
        for i in range(19):
            publisher.publish("", "q", b"x" * 1000, message_id=f"m-{i}")
        started = time.monotonic()
        with pytest.raises(PublishTimeout, match="spool_max_bytes"):
            for i in range(19, 40):
                publisher.publish("", "q", b"x" * 1000, message_id=f"m-{i}")
        assert 0.4 < time.monotonic() - started < 5
        publisher.close(timeout=0.2)


def test_two_publishers_on_one_spool_are_refused(kind: Kind, amqp_url: str, tmp_path: Path) -> None:
    first = kind(amqp_url, spool=tmp_path / "s")
    try:
        for other in (Publisher, SpooledAsync):
            with pytest.raises(ConfigurationError) as info:
                other(amqp_url, spool=tmp_path / "s")
            assert f"in use by process {os.getpid()}" in str(info.value)
            assert str(tmp_path / "s") in str(info.value)
    finally:
        first.close()
    kind(amqp_url, spool=tmp_path / "s").close()  # free again once closed


def test_persist_needs_a_spool(amqp_url: str) -> None:
    with Publisher(amqp_url) as publisher, pytest.raises(ConfigurationError, match="spool"):
        publisher.persist()


def test_publishing_from_threads_keeps_each_threads_order(
    amqp_url: str, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    queue = broker.queue()
    with Publisher(proxy.url(), spool=tmp_path / "s", max_in_flight=64) as publisher:

        def worker(n: int) -> None:
            for i in range(500):
                publisher.publish("", queue, b"", message_id=f"t{n}-{i}")

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        proxy.cut()  # a connection loss in the middle
        for t in threads:
            t.join()
        assert publisher.flush(60) == 0
    got = ids(broker, queue)
    for n in range(4):
        mine = [i for i in got if i.startswith(f"t{n}-")]
        # republished after the cut: duplicates allowed, never a later one before an earlier
        firsts = list(dict.fromkeys(mine))
        assert firsts == [f"t{n}-{i}" for i in range(500)]


def test_a_spool_whose_last_entries_failed_flushes_to_zero(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    spool = Spool(tmp_path / "s")
    sent = [build_message("", queue, b"", properties={"message_id": f"m-{i}"}) for i in range(6)]
    for message in sent:
        spool.append(message)
    spool.persist()
    spool.fail(6, sent[5], "returned")  # the highest seq is in the failed table, not pending
    spool.close()
    with kind(amqp_url, spool=tmp_path / "s") as publisher:
        assert publisher.flush(30) == 0
        publisher.publish("", queue, b"", message_id="new")
        assert publisher.flush(30) == 0
    assert ids(broker, queue) == [f"m-{i}" for i in range(5)] + ["new"]


def test_kept_and_watched_futures_resolve_and_dropped_ones_are_forgotten(
    kind: Kind, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    queue = broker.queue()
    proxy.refuse()
    count = 12_000  # several times PRUNE_MIN: the waiting futures are pruned meanwhile
    called: list[str] = []
    lock = threading.Lock()

    def done(future: Any) -> None:
        with lock:
            called.append(future.result().message_id)

    with kind(proxy.url(), spool=tmp_path / "s", max_in_flight=100) as publisher:
        kept = []
        for i in range(count):
            future = publisher.publish("", queue, b"%d" % i, message_id=f"m-{i}")
            if i % 3 == 0:
                kept.append(future)  # kept by the caller
            elif i % 3 == 1:
                future.add_done_callback(done)  # only watched: the callback must still run
            # else dropped at once: nothing of it may stay in memory
        if kind is Publisher:
            waiting = len(publisher._spooled.feed.waiting)
            assert waiting < count * 2 // 3 + PRUNE_MIN, waiting
        proxy.accept()
        assert publisher.flush(120) == 0
    assert [f.result(5).message_id for f in kept] == [f"m-{i}" for i in range(0, count, 3)]
    deadline = time.monotonic() + 10
    while len(called) < count // 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the async driver's callbacks run on its loop thread
    assert sorted(called) == sorted(f"m-{i}" for i in range(1, count, 3))
    assert ids(broker, queue) == [f"m-{i}" for i in range(count)]
