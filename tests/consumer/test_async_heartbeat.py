"""AsyncConsumer's heartbeats while a handler runs long (issue 47), against the real broker.

The async consumer's connection lives on the event loop (``_consume/_aio_io.py``): pika's
heartbeat timers run only when the loop does. A handler that *awaits* for several heartbeats
costs them nothing. A handler that *blocks* the loop (``time.sleep`` inside ``async def``) stops
them: the consumer's watchdog thread then writes the heartbeats itself and says so at WARNING,
so the link lives and nothing is redelivered. Where the watchdog cannot write (a TLS
connection: an SSL socket belongs to the loop's thread), the broker closes the connection after
two missed heartbeats: the consumer says so, reconnects once the loop runs again, and the
message comes back (redelivered) and is handled again: never lost, never silent.

Heartbeat 1 s (the broker takes the client's proposal), handlers 3.5 heartbeats long.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from reliable_amqp import AsyncConsumer, Delivery
from reliable_amqp._compat.pika import LoopScanningConnection
from reliable_amqp._consume._aio_io import LoopConsumerIO
from support.broker import BrokerAdmin, unique
from support.consumer import QUICK, delete_queues, fill, side_queues, warnings_logged

pytestmark = [pytest.mark.broker]

HEARTBEAT = 1
LONG = 3.5 * HEARTBEAT


@pytest.fixture
def own_queues(amqp_url: str) -> Iterator[list[str]]:
    """Queues a consumer declared for itself (dead letters, delay levels), deleted after."""
    queues: list[str] = []
    yield queues
    for queue in queues:
        delete_queues(amqp_url, side_queues(queue, QUICK))


def _consume(
    consumer: AsyncConsumer, ids: list[str], blocking: bool, until_redelivered: bool = False
) -> list[tuple[str, bool]]:
    """Run ``consumer`` until each of ``ids`` was handled to the end (with
    ``until_redelivered``, until one redelivered call ended); the calls it saw. Each first
    delivery's handler takes LONG, blocking the loop or awaiting."""
    calls: list[tuple[str, bool]] = []
    done: set[str] = set()

    async def handler(delivery: Delivery) -> None:
        calls.append((delivery.message_id or "", delivery.redelivered))
        if delivery.redelivered:
            pass
        elif blocking:
            # a turn of the loop first, so that its due timers (the watchdog's beat) run between
            # two blocking calls: with concurrency=1 the next handler may start in the step the
            # last one ended in, and the watchdog then rightly sees one stall of both (the test
            # failed 1 run in 2 that way: one stall of 7.0 s, not two)
            await asyncio.sleep(0.05)
            time.sleep(LONG)  # blocks the event loop itself: no timer of pika's runs meanwhile
        else:
            await asyncio.sleep(LONG)
        done.add(delivery.message_id or "")
        if (delivery.redelivered or not until_redelivered) and done >= set(ids):
            consumer.stop()

    asyncio.run(asyncio.wait_for(consumer.run(handler), 120))
    return calls


def _link(consumer: AsyncConsumer) -> LoopConsumerIO:
    io = consumer._core.io
    assert isinstance(io, LoopConsumerIO)
    return io


@pytest.mark.parametrize("blocking", [False, True], ids=["awaiting", "blocking"])
def test_a_handler_three_heartbeats_long_keeps_the_link(
    blocking: bool,
    amqp_url: str,
    broker: BrokerAdmin,
    own_queues: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    queue = broker.queue(unique("c-async-hb"))
    own_queues.append(queue)
    ids = ["long-1", "long-2"]
    fill(amqp_url, queue, ids)
    consumer = AsyncConsumer(amqp_url, queue, prefetch=10, heartbeat=HEARTBEAT, redelivery=QUICK)
    calls = _consume(consumer, ids, blocking)
    io = _link(consumer)
    assert calls == [(i, False) for i in ids]  # each once, never redelivered
    assert io.recoveries == 0 and io.generation == 1
    warnings = warnings_logged(caplog)
    assert not [w for w in warnings if "lost its" in w], warnings
    stalls = [w for w in warnings if "has not run for" in w]
    if blocking:  # said, once per blocking call, with what the watchdog does about it
        assert len(stalls) == len(ids), warnings
        assert all("watchdog thread sends the connection's heartbeats" in w for w in stalls)
        assert len([w for w in warnings if "ran again after" in w]) == len(ids), warnings
    else:
        assert not stalls, warnings
    assert broker.count(queue) == 0


def test_a_blocking_handler_where_heartbeats_cannot_be_written_is_said_and_redelivered(
    amqp_url: str,
    broker: BrokerAdmin,
    own_queues: list[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As on a TLS connection (the watchdog cannot write to an SSL socket from its thread): the
    broker closes the connection after two missed heartbeats. The WARNINGs say so; the consumer
    reconnects when the loop runs again, the blocked message's ack is dropped (its channel is
    gone) and it comes back redelivered, handled again, nothing lost."""
    monkeypatch.setattr(LoopScanningConnection, "heartbeat_from_thread", lambda self: False)
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    queue = broker.queue(unique("c-async-hb-tls"))
    own_queues.append(queue)
    fill(amqp_url, queue, ["only"])
    consumer = AsyncConsumer(amqp_url, queue, prefetch=10, heartbeat=HEARTBEAT, redelivery=QUICK)
    calls = _consume(consumer, ["only"], blocking=True, until_redelivered=True)
    io = _link(consumer)
    warnings = warnings_logged(caplog)
    assert any("cannot be written from another thread" in w for w in warnings), warnings
    assert any("lost its" in w for w in warnings), warnings  # the loss, said
    assert io.recoveries >= 1
    # the first call's ack was for a dead channel (never sent); the broker redelivered it
    assert calls == [("only", False), ("only", True)], calls
    assert broker.count(queue) == 0
