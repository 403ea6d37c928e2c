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

``--variants`` adds rows that take one design choice of AsyncPublisher away at a time (see
docs/async.md): aio-pika with everything gathered at once, aiormq's own ``basic_publish``
beneath aio-pika, and AsyncPublisher with pamqp marshalling or one write per message. Every row
also reports this process's CPU time per message.
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
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq
import pamqp.commands
import pamqp.frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from reliable_amqp._async import AsyncPublisher
from reliable_amqp._core import engine

Row = dict[str, Any]
URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
GATHER = 1_000

NO_CONFIRMS = "aio-pika, no confirms"
CONFIRMS = f"aio-pika, publisher_confirms=True (gather {GATHER:,})"
ASYNC_PUBLISHER = "reliable_amqp.AsyncPublisher (streaming confirms)"


def _row(name: str, count: int, seconds: float, cpu: float) -> Row:
    """A result; ``cpu_us`` is this process's CPU time per message over the timed span."""
    return {
        "name": name,
        "msgs": count,
        "seconds": seconds,
        "rate": count / seconds,
        "cpu_us": cpu / count * 1e6,
    }


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
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            await exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key=queue)
        # The clock stops at a round trip after the last publish (answered once the broker has
        # routed everything sent before it on this channel).
        await channel.declare_queue(queue, passive=True)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        await _settle(connection, queue, count)
    return _row(NO_CONFIRMS, count, seconds, cpu)


async def aio_pika_confirms(url: str, count: int, body: bytes) -> Row:
    """aio-pika with publisher confirms, publishes gathered in batches of 1,000."""
    async with fresh_queue(url) as (connection, queue):
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        started, cpu = time.perf_counter(), time.process_time()
        for start in range(0, count, GATHER):
            await asyncio.gather(
                *(
                    exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key=queue)
                    for _ in range(min(GATHER, count - start))
                )
            )
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return _row(CONFIRMS, count, seconds, cpu)


async def async_publisher(url: str, count: int, body: bytes, mandatory: bool = True) -> Row:
    """reliable_amqp.AsyncPublisher: streaming confirms, every future checked (mandatory, the
    default; ``mandatory=False``: what the default cost before it was mandatory)."""
    async with (
        fresh_queue(url) as (_connection, queue),
        AsyncPublisher(url, mandatory=mandatory) as publisher,
    ):
        started, cpu = time.perf_counter(), time.process_time()
        futures = [await publisher.publish("", queue, body) for _ in range(count)]
        left = await publisher.flush(timeout=120)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        confirmed = sum(1 for f in futures if f.done() and f.exception() is None)
    if left or confirmed != count:
        raise RuntimeError(f"AsyncPublisher confirmed {confirmed} of {count} ({left} pending)")
    name = ASYNC_PUBLISHER if mandatory else f"{ASYNC_PUBLISHER}, mandatory=False"
    return _row(name, count, seconds, cpu)


async def async_publisher_not_mandatory(url: str, count: int, body: bytes) -> Row:
    """The AsyncPublisher row with ``mandatory=False``: the cost of mandatory, side by side."""
    return await async_publisher(url, count, body, mandatory=False)


MANY = 1_000


async def async_publisher_many(url: str, count: int, body: bytes) -> Row:
    """reliable_amqp.AsyncPublisher.publish_many(): 1,000 bodies a call, every future checked."""
    async with fresh_queue(url) as (_connection, queue), AsyncPublisher(url) as publisher:
        started, cpu = time.perf_counter(), time.process_time()
        futures: list[asyncio.Future[Any]] = []
        for start in range(0, count, MANY):
            futures += await publisher.publish_many("", queue, [body] * min(MANY, count - start))
        left = await publisher.flush(timeout=120)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        confirmed = sum(1 for f in futures if f.done() and f.exception() is None)
    if left or confirmed != count:
        raise RuntimeError(f"publish_many confirmed {confirmed} of {count} ({left} pending)")
    return _row(f"reliable_amqp.AsyncPublisher.publish_many ({MANY:,} a call)", count, seconds, cpu)


#: name -> row coroutine, in table order
ROWS: dict[str, Callable[[str, int, bytes], Awaitable[Row]]] = {
    "aio-pika-noconfirm": aio_pika_no_confirms,
    "aio-pika-confirm": aio_pika_confirms,
    "async-publisher": async_publisher,
    "async-publisher-not-mandatory": async_publisher_not_mandatory,
    "async-publisher-many": async_publisher_many,
}


def rows(
    url: str, count: int, body: bytes, before_row: Callable[[], object] | None = None
) -> list[Row]:
    """Run every async row once, in one event loop; returns them in table order.
    ``before_row`` runs before each (the benchmark waits there for an idle broker)."""

    async def run_all() -> list[Row]:
        results = []
        for fn in ROWS.values():
            if before_row is not None:
                before_row()
            results.append(await fn(url, count, body))
        return results

    return asyncio.run(run_all())


# --- design variants (--variants): what each choice in AsyncPublisher is worth -----------------


async def aio_pika_gather_all(url: str, count: int, body: bytes) -> Row:
    """aio-pika confirms with every publish gathered at once (no batches of 1,000)."""
    async with fresh_queue(url) as (connection, queue):
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(
            *(
                exchange.publish(aio_pika.Message(body, delivery_mode=2), routing_key=queue)
                for _ in range(count)
            )
        )
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return _row("aio-pika confirms, all gathered at once", count, seconds, cpu)


async def aiormq_confirms(url: str, count: int, body: bytes) -> Row:
    """One level down: aiormq ``basic_publish(wait=False)`` (no socket drain per message), but
    still its lock, confirmation future and map entry per message; gathered by 1,000."""
    async with fresh_queue(url) as (connection, queue):
        assert connection.transport is not None
        channel = await connection.transport.connection.channel(publisher_confirms=True)
        assert isinstance(channel, aiormq.Channel)  # basic_publish(wait=...) is the class's
        properties = pamqp.commands.Basic.Properties(delivery_mode=2)
        started, cpu = time.perf_counter(), time.process_time()
        for start in range(0, count, GATHER):
            await asyncio.gather(
                *(
                    channel.basic_publish(
                        body, routing_key=queue, properties=properties, wait=False
                    )
                    for _ in range(min(GATHER, count - start))
                )
            )
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        await channel.close()
    return _row("aiormq basic_publish(wait=False), gather 1,000", count, seconds, cpu)


def _pamqp_frames(
    channel: int,
    message: Any,
    headers: Any,
    frame_max: int,
    out: list[bytes | memoryview],
    *,
    broker: Any = None,
) -> None:
    """AsyncPublisher's frames marshalled by pamqp, as aiormq marshals them (the signature of
    ``_core.frames.publish_frames``)."""
    p = message.base
    props = pamqp.commands.Basic.Properties(
        delivery_mode=p.delivery_mode,
        message_id=message.message_id or None,
        headers=headers or p.headers,
    )
    publish = pamqp.commands.Basic.Publish(
        exchange=message.exchange, routing_key=message.routing_key, mandatory=message.mandatory
    )
    out.append(pamqp.frame.marshal(publish, channel))
    out.append(pamqp.frame.marshal(ContentHeader(0, len(message.body), props), channel))
    out.append(pamqp.frame.marshal(ContentBody(message.body), channel))


class _PamqpEncoder:
    """``_core.frames.PublishEncoder`` (the engine's fast path for runs of messages) by pamqp."""

    def __init__(self, channel: int, frame_max: int, broker: Any = None) -> None:
        self.channel, self.frame_max, self.broker = channel, frame_max, broker

    def encode(self, message: Any, out: list[bytes | memoryview]) -> None:
        _pamqp_frames(self.channel, message, None, self.frame_max, out)


async def async_publisher_pamqp(url: str, count: int, body: bytes) -> Row:
    """AsyncPublisher with pamqp marshalling instead of its own: the engine's two encoders
    (one message, and a run of them) replaced where the engine looks them up."""
    saved = {name: vars(engine)[name] for name in ("publish_frames", "PublishEncoder")}
    setattr(engine, "publish_frames", _pamqp_frames)  # noqa: B010 (where the engine looks)
    setattr(engine, "PublishEncoder", _PamqpEncoder)  # noqa: B010
    try:
        row = await async_publisher(url, count, body)
    finally:
        for name, value in saved.items():
            setattr(engine, name, value)
    return {**row, "name": "AsyncPublisher, frames marshalled by pamqp"}


async def async_publisher_unbatched(url: str, count: int, body: bytes) -> Row:
    """AsyncPublisher writing one message per write-queue entry and socket drain."""
    original = engine.BATCH_COUNT
    engine.BATCH_COUNT = 1  # read by PublishEngine.write() at each batch
    try:
        row = await async_publisher(url, count, body)
    finally:
        engine.BATCH_COUNT = original
    return {**row, "name": "AsyncPublisher, one write per message"}


VARIANTS: dict[str, Callable[[str, int, bytes], Awaitable[Row]]] = {
    "aio-pika-gather-all": aio_pika_gather_all,
    "aiormq-confirm": aiormq_confirms,
    "async-publisher-pamqp": async_publisher_pamqp,
    "async-publisher-unbatched": async_publisher_unbatched,
}


def _best(runs: list[list[Row]]) -> list[Row]:
    return [max(group, key=lambda r: float(r["rate"])) for group in zip(*runs, strict=True)]


def table(result: list[Row]) -> str:
    """The rows, with client CPU per message and the two ratios the async target is set in."""
    rate = {str(r["name"]): float(r["rate"]) for r in result}
    lines = [f"{'row':<52} {'msgs/s':>10} {'client CPU/msg':>15}"]
    for r in result:
        rps, cpu = float(r["rate"]), float(r["cpu_us"])
        lines.append(f"{r['name']!s:<52} {rps:>10,.0f} {cpu:>12.1f} us")
    ours = rate.get(ASYNC_PUBLISHER)
    if ours and CONFIRMS in rate and NO_CONFIRMS in rate:
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
    parser.add_argument(
        "--variants", action="store_true", help="also the design variants (docs/async.md)"
    )
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    functions = list(ROWS.values()) + (list(VARIANTS.values()) if args.variants else [])

    async def run_all(body: bytes) -> list[Row]:
        return [await fn(args.url, args.count, body) for fn in functions]

    for size in (int(s) for s in args.sizes.split(",")):
        body = b"x" * size
        runs = [asyncio.run(run_all(body)) for _ in range(args.repeat)]
        print(f"\n== {args.count:,} persistent messages, {size} B bodies, durable queue ==")
        print(table(_best(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
