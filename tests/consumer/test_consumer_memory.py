"""A consumer's memory does not grow with what it has consumed: measured at two sizes far apart.

"prefetch bounds what a consumer holds" (docs/consumer.md, "Choosing prefetch") is a bound only
if it holds at 100,000 messages and at 400,000 alike. A child process consumes one queue of
402,000 messages and reports its resident set's growth, from after a 2,000-message warm-up, at
100,000 and at 400,000 handled. A cost per message left behind (an ack tag, a delivery, a record
of attempts) shows as growth between the two marks: a handler that kept each ``message_id``
made it 25.5 MB, against under 1 MB without.
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from reliable_amqp import AsyncConsumer, Consumer, Delivery
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

    def note() -> bool:
        """Count one handled message, record at the marks; True at the last."""
        nonlocal before, handled
        handled += 1
        if handled == WARM_UP:
            before = sample()
        elif handled - WARM_UP in MARKS:
            now = sample()
            grown.append((now[0] - before[0], now[1] - before[1]))
        return handled == total

    if kind == "sync":
        consumer = Consumer(url, queue, prefetch=PREFETCH)

        def handle(delivery: Delivery) -> None:
            if note():
                consumer.stop()

        consumer.run(handle)
    else:
        async_consumer = AsyncConsumer(url, queue, prefetch=PREFETCH)

        async def handle_async(delivery: Delivery) -> None:
            if note():
                async_consumer.stop()

        asyncio.run(asyncio.wait_for(async_consumer.run(handle_async), 900))
    assert handled == total, handled
    return grown


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_consumer_memory_does_not_grow_with_what_it_consumed(
    kind: str, amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue(unique(f"c-memory-{kind}"))
    # transient messages: a third quicker to fill, and the consumer's side is the same
    fill_numbered(amqp_url, queue, WARM_UP + MARKS[-1], delivery_mode=1)
    try:
        grown = run_child(__file__, kind, amqp_url, queue)
    finally:  # the child's consumer declared its dead-letter and delay queues (the default policy)
        delete_queues(amqp_url, side_queues(queue, DEFAULT_REDELIVERY))
    check_flat(f"{kind} consumer", grown)
    assert broker.count(queue) == 0


if __name__ == "__main__":  # the child: KIND URL QUEUE
    print(json.dumps(_consume_rss(sys.argv[1], sys.argv[2], sys.argv[3])))
