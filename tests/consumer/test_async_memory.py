"""AsyncConsumer on its event-loop I/O (issue 47): memory flat at 100,000 and 400,000 messages.

The same measure as ``test_consumer_memory.py`` (a child process consumes 402,000 messages with
prefetch 300 and reports its resident set's and Python's allocated blocks' growth from after a
2,000-message warm-up, at 100,000 and at 400,000 handled), for what that file does not run:
``concurrency=16`` (sixteen workers, handlers that suspend, so every worker takes turns and acks
finish out of order) with ``key=`` over 1,000 keys (the per-key bookkeeping of the workers).
Anything the new I/O kept per message (an ack tag, a delivery, a timer, a waiter, a key's queue)
would show as growth between the two marks. Measured 2026-11-29: with the key, RSS +0.0 MB and
+1,356 Python blocks after 100,000, +0.0 MB and -482 after 400,000; sixteen workers without a
key (a run of this file before it kept the keyed case only), +0.0 MB, +1,141 and -169.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from reliable_amqp import AsyncConsumer, Delivery
from reliable_amqp._consume._aio_io import LoopConsumerIO
from reliable_amqp._consume._options import DEFAULT_REDELIVERY
from support.broker import BrokerAdmin, unique
from support.consumer import delete_queues, side_queues
from support.memory import MARKS, WARM_UP, check_flat, fill_numbered, run_child, sample

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PREFETCH = 300


def _consume_rss(kind: str, url: str, queue: str) -> list[tuple[int, int]]:
    """The child's part: consume WARM_UP + MARKS[-1] messages; growth at each mark."""
    grown: list[tuple[int, int]] = []
    before = (0, 0)
    total = WARM_UP + MARKS[-1]
    handled = 0
    consumer = AsyncConsumer(
        url,
        queue,
        prefetch=PREFETCH,
        concurrency=16,
        key=(lambda d: d.body[5:8].decode()) if kind == "keyed" else None,  # 1,000 keys
    )
    assert isinstance(consumer._core.io, LoopConsumerIO)

    async def handle(delivery: Delivery) -> None:
        nonlocal before, handled
        await asyncio.sleep(0)  # suspends: the next delivery goes to another worker
        handled += 1
        if handled == WARM_UP:
            before = sample()
        elif handled - WARM_UP in MARKS:
            now = sample()
            grown.append((now[0] - before[0], now[1] - before[1]))
        if handled == total:
            consumer.stop()

    asyncio.run(asyncio.wait_for(consumer.run(handle), 900))
    assert handled == total, handled
    return grown


@pytest.mark.parametrize("kind", ["keyed"])
def test_async_consumer_memory_does_not_grow_with_what_it_consumed(
    kind: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue(unique(f"c-async-memory-{kind}"))
    fill_numbered(amqp_url, queue, WARM_UP + MARKS[-1], delivery_mode=1)
    try:
        grown = run_child(__file__, kind, amqp_url, queue)
    finally:  # the child's consumer declared its dead-letter and delay queues (the default policy)
        delete_queues(amqp_url, side_queues(queue, DEFAULT_REDELIVERY))
    check_flat(f"async consumer ({kind})", grown)
    assert broker.count(queue) == 0


if __name__ == "__main__":  # the child: KIND URL QUEUE
    print(json.dumps(_consume_rss(sys.argv[1], sys.argv[2], sys.argv[3])))
