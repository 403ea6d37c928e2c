"""Messages recovered from a spool wait for the caller's topology (issue 20).

A spool left by an earlier run is replayed with the caller's first ``publish()``, ``flush()`` or
``close()``, not as soon as the publisher connects: the declarations made before that are in
place. A recovered message that still reaches no queue is returned (recovered messages go out
mandatory) and lands in the spool's failed table with its reason. Against the real broker.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.proxy import TcpProxy
from reliable_amqp import (
    EventKind,
    MessageReturned,
    PublisherClosed,
    PublisherEvent,
    PublishError,
)
from reliable_amqp._core.builder import build_message
from reliable_amqp._spool import Spool, failed_entries, inspect
from support.broker import BrokerAdmin, unique
from support.spool import Kind

pytestmark = pytest.mark.broker


def _leave_in_spool(kind: Kind, proxy: TcpProxy, directory: Path, queue: str, count: int) -> None:
    """What a run that never reached the broker leaves: ``count`` messages for ``queue``."""
    proxy.refuse()
    publisher = kind(proxy.url(), spool=directory)
    futures = [publisher.publish("", queue, b"%d" % i, message_id=f"m-{i}") for i in range(count)]
    assert publisher.persist(30) == 0
    assert publisher.close(timeout=0.2) > 0
    assert isinstance(futures[-1].exception(5), PublisherClosed)
    assert inspect(directory).pending == count
    proxy.accept()


def test_recovered_messages_wait_for_a_queue_declared_after_the_constructor(
    kind: Kind, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    directory = tmp_path / "s"
    queue = unique("later")  # does not exist until the second run declares it
    _leave_in_spool(kind, proxy, directory, queue, 5000)
    publisher = kind(proxy.url(), spool=directory)
    try:
        publisher.connect()
        time.sleep(0.5)  # connected meanwhile: nothing may go out before the declaration
        publisher.declare_queue(queue)
        broker.queue(queue)  # (the same declaration, so that the test deletes it after)
        assert publisher.flush(60) == 0
    finally:
        publisher.close()
    got = [props.message_id for props, _ in broker.drain(queue)]
    assert got == [f"m-{i}" for i in range(5000)]
    summary = inspect(directory)
    assert (summary.pending, summary.failed) == (0, 0)


def test_recovered_messages_go_out_with_the_first_publish_after_the_declaration(
    kind: Kind, broker: BrokerAdmin, proxy: TcpProxy, tmp_path: Path
) -> None:
    directory = tmp_path / "s"
    queue = unique("later")
    _leave_in_spool(kind, proxy, directory, queue, 300)
    with kind(proxy.url(), spool=directory) as publisher:
        time.sleep(0.3)
        publisher.declare_queue(queue)
        broker.queue(queue)
        publisher.publish("", queue, b"new", message_id="new")
        assert publisher.flush(60) == 0
    got = [props.message_id for props, _ in broker.drain(queue)]
    assert got == [f"m-{i}" for i in range(300)] + ["new"]


def test_a_recovered_message_no_queue_takes_lands_in_the_failed_table(
    kind: Kind, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    missing_exchange = unique("no-such-exchange")
    no_queue = unique("no-such-queue")
    spool = Spool(tmp_path / "s")
    for i in range(30):
        exchange, key = "", queue
        if i == 7:
            exchange = missing_exchange
        elif i == 20:
            key = no_queue  # the default exchange routes to no queue: returned
        # stored non-mandatory, as spools written before mandatory was the default hold them
        spool.append(build_message(exchange, key, b"%d" % i, properties={"message_id": f"m-{i}"}))
    spool.close()
    events: list[PublisherEvent] = []
    with kind(amqp_url, spool=tmp_path / "s", on_event=events.append) as publisher:
        assert publisher.flush(30) == 0
    # the channel the 404 closed had others in flight: republished, so duplicates may come
    got = list(dict.fromkeys(props.message_id for props, _ in broker.drain(queue)))
    assert got == [f"m-{i}" for i in range(30) if i not in (7, 20)]
    failed = {f.message.message_id: f.reason for f in failed_entries(tmp_path / "s")}
    assert set(failed) == {"m-7", "m-20"}
    assert "MessageRejected" in failed["m-7"] and "404" in failed["m-7"]
    assert missing_exchange in failed["m-7"]
    assert "MessageReturned" in failed["m-20"] and "NO_ROUTE" in failed["m-20"]
    reported = {
        e.error.message.message_id: e.error
        for e in events
        if e.kind is EventKind.SPOOL_FAILED and isinstance(e.error, PublishError)
    }
    assert set(reported) == {"m-7", "m-20"}
    assert isinstance(reported["m-20"], MessageReturned)
    assert inspect(tmp_path / "s").pending == 0
