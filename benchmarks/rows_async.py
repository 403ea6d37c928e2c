"""Async benchmark rows: aio-pika's two ways against reliable_amqp.AsyncPublisher.

    python benchmarks/rows_async.py                 # 20,000 messages, 12 B and 1 KiB bodies
    python benchmarks/rows_async.py --count 5000 --repeat 3

Each row publishes ``count`` persistent messages to a fresh durable queue (declared and deleted
with aio-pika, untimed) and reports msgs/s, timed from the first publish to the last confirm
(for "no confirms": to the last publish returned). Connection set-up is not timed.

- ``aio-pika, no confirms``: ``channel(publisher_confirms=False)``, ``await exchange.publish()``
  in a loop;
- ``aio-pika, publisher_confirms=True``: the default channel, publishes gathered in batches of
  1,000 (``asyncio.gather``), every batch awaited before the next;
- ``reliable_amqp.AsyncPublisher``: ``await publisher.publish()`` in a loop, then ``flush()``;
  every future is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aio_pika
import aio_pika.abc

from reliable_amqp._async import AsyncPublisher

Row = dict[str, object]
URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
GATHER = 1_000

NO_CONFIRMS = "aio-pika, no confirms"
CONFIRMS = f"aio-pika, publisher_confirms=True (gather {GATHER:,})"
ASYNC_PUBLISHER = "reliable_amqp.AsyncPublisher (streaming confirms)"


def _row(name: str, count: int, seconds: float) -> Row:
    return {"name": name, "msgs": count, "seconds": seconds, "rate": count / seconds}


@asynccontextmanager
async def fresh_queue(url: str) -> AsyncIterator[tuple[aio_pika.abc.AbstractConnection, str]]:
    """An aio-pika connection and a new durable queue, deleted afterwards."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(f"ra-bench-{uuid.uuid4().hex[:10]}", durable=True)
        try:
            yield connection, queue.name
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


async def _settle(connection: aio_pika.abc.AbstractConnection, queue: str, count: int) -> None:
    """Untimed: wait until the broker holds every message, so the next row starts from quiet."""
    channel = await connection.channel()
    while True:
        declared = await channel.declare_queue(queue, passive=True)
        if (declared.declaration_result.message_count or 0) >= count:
            break
        await asyncio.sleep(0.05)
    await channel.close()


async def aio_pika_no_confirms(url: str, count: int, body: bytes) -> Row:
    """aio-pika without confirm mode: each publish returns once its frames are written."""
    async with fresh_queue(url) as (connection, queue):
        channel = await connection.channel(publisher_confirms=False)
        exchange = channel.default_exchange
        started = time.perf_counter()
        for _ in range(count):
            await exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key=queue)
        seconds = time.perf_counter() - started
        await _settle(connection, queue, count)
    return _row(NO_CONFIRMS, count, seconds)


async def aio_pika_confirms(url: str, count: int, body: bytes) -> Row:
    """aio-pika with publisher confirms, publishes gathered in batches of 1,000."""
    async with fresh_queue(url) as (connection, queue):
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        started = time.perf_counter()
        for start in range(0, count, GATHER):
            await asyncio.gather(
                *(
                    exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key=queue)
                    for _ in range(min(GATHER, count - start))
                )
            )
        seconds = time.perf_counter() - started
    return _row(CONFIRMS, count, seconds)


async def async_publisher(url: str, count: int, body: bytes) -> Row:
    """reliable_amqp.AsyncPublisher: streaming confirms, every future checked."""
    async with fresh_queue(url) as (_connection, queue), AsyncPublisher(url) as publisher:
        started = time.perf_counter()
        futures = [await publisher.publish("", queue, body) for _ in range(count)]
        left = await publisher.flush(timeout=120)
        seconds = time.perf_counter() - started
        confirmed = sum(1 for f in futures if f.done() and f.exception() is None)
    if left or confirmed != count:
        raise RuntimeError(f"AsyncPublisher confirmed {confirmed} of {count} ({left} pending)")
    return _row(ASYNC_PUBLISHER, count, seconds)


#: name -> row coroutine, in table order
ROWS: dict[str, Callable[[str, int, bytes], Awaitable[Row]]] = {
    "aio-pika-noconfirm": aio_pika_no_confirms,
    "aio-pika-confirm": aio_pika_confirms,
    "async-publisher": async_publisher,
}


def rows(url: str, count: int, body: bytes) -> list[Row]:
    """Run every async row once, in one event loop; returns them in table order."""

    async def run_all() -> list[Row]:
        return [await fn(url, count, body) for fn in ROWS.values()]

    return asyncio.run(run_all())


def _best(runs: list[list[Row]]) -> list[Row]:
    return [max(group, key=lambda r: float(r["rate"])) for group in zip(*runs, strict=True)]


def table(result: list[Row]) -> str:
    """The rows with the two ratios the async target is stated in."""
    rate = {str(r["name"]): float(r["rate"]) for r in result}  # type: ignore[arg-type]
    lines = [f"{'row':<52} {'msgs/s':>10}"]
    lines += [f"{r['name']!s:<52} {float(r['rate']):>10,.0f}" for r in result]  # type: ignore[arg-type]
    ours = rate[ASYNC_PUBLISHER]
    lines.append(
        f"AsyncPublisher: {ours / rate[CONFIRMS]:.2f}x aio-pika confirmed (target >= 2), "
        f"{ours / rate[NO_CONFIRMS]:.2f}x aio-pika without confirms (target >= 0.9)"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--sizes", default="12,1024", help="body sizes in bytes, comma separated")
    parser.add_argument("--repeat", type=int, default=1, help="best of this many runs per row")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        body = b"x" * size
        runs = [rows(args.url, args.count, body) for _ in range(args.repeat)]
        print(f"\n== {args.count:,} persistent messages, {size} B bodies, durable queue ==")
        print(table(_best(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
