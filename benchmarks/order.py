"""What per-key order costs a consumer, and what one failing key costs the others (issue 46).

    bash scripts/dev.sh run python benchmarks/order.py                    # both parts
    bash scripts/dev.sh run python benchmarks/order.py --count 20000 --repeat 3 --fail-seconds 60

Part 1, cost: ``AsyncConsumer(concurrency=16)`` consumes ``--count`` messages spread over
``--keys`` keys (1,000), with ``key="header:entity"`` and without, alternating, ``--repeat``
times, in one run; each row's rate runs from the first message handled to the last. The ratio
keyed/unkeyed is printed (the issue's target: at least 0.8).

Part 2, one key failing: the same consumer with ``key=``, messages over ``--keys`` keys arriving
continuously; one key's first message fails for ``--fail-seconds`` (its retries fail until
then). The other keys' rate while it fails is printed against their rate without a failing key,
with the most unacked messages the consumer's channel held (sampled every 0.1 s)
and the consumer's largest RSS; the failing key's events are checked to run after it, in order.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid
from collections import defaultdict

import pika

from reliable_amqp import AsyncConsumer, Delivery, Publisher, RetryPolicy

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
POLICY = RetryPolicy(max_attempts=50, initial_delay=1.0, max_delay=2.0, jitter=0.0)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fill(queue: str, count: int, keys: int, start: int = 0) -> None:
    with Publisher(URL, max_in_flight=5000) as publisher:
        for i in range(start, start + count):
            key = f"k{i % keys}"
            publisher.publish("", queue, b"x", message_id=f"{key}/{i}", headers={"entity": key})
        assert publisher.flush(300) == 0


def fresh_queue() -> str:
    name = f"bench-order-{uuid.uuid4().hex[:8]}"
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    connection.channel().queue_declare(name, durable=True)
    connection.close()
    return name


def drop(queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    for name in [
        queue,
        f"{queue}.dead",
        f"{queue}.retry.1000ms",
        f"{queue}.retry.1500ms",
        f"{queue}.retry.2000ms",
        f"{queue}.retry.3000ms",
    ]:
        channel.queue_delete(name)
    connection.close()


def consume_rate(count: int, keys: int, keyed: bool) -> float:
    queue = fresh_queue()
    try:
        fill(queue, count, keys)
        consumer = AsyncConsumer(
            URL,
            queue,
            prefetch=200,
            concurrency=16,
            redelivery=POLICY,
            key="header:entity" if keyed else None,
        )
        marks: list[float] = []

        async def handler(delivery: Delivery) -> None:
            marks.append(time.perf_counter())
            if len(marks) == count:
                consumer.stop()

        asyncio.run(consumer.run(handler))
        return (count - 1) / (marks[-1] - marks[0])
    finally:
        drop(queue)


def part1(count: int, keys: int, repeat: int) -> None:
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeat):
        for with_key in (False, True):
            rates[with_key].append(consume_rate(count, keys, with_key))
    plain, keyed = max(rates[False]), max(rates[True])
    print(
        f"part 1: {count:,} messages over {keys:,} keys, AsyncConsumer(concurrency=16), "
        f"best of {repeat}, alternating"
    )
    print(f"  without key   {plain:>10,.0f} msg/s   runs {[round(r) for r in rates[False]]}")
    print(f"  key=header    {keyed:>10,.0f} msg/s   runs {[round(r) for r in rates[True]]}")
    print(f"  keyed / unkeyed = {keyed / plain:.2f}x (target >= 0.8)")


def part2(keys: int, fail_seconds: float, rate: int) -> None:
    queue = fresh_queue()
    stop_feed = threading.Event()
    sent = 0

    def feed() -> None:  # `rate` messages a second, spread over the keys
        nonlocal sent
        with Publisher(URL, max_in_flight=5000) as publisher:
            next_at = time.monotonic()
            while not stop_feed.is_set():
                for _ in range(rate // 10):
                    key = f"k{sent % keys}"
                    publisher.publish(
                        "", queue, b"x", message_id=f"{key}/{sent}", headers={"entity": key}
                    )
                    sent += 1
                next_at += 0.1
                time.sleep(max(0.0, next_at - time.monotonic()))
            publisher.flush(120)

    consumer = AsyncConsumer(
        URL, queue, prefetch=200, concurrency=16, redelivery=POLICY, key="header:entity"
    )
    handled: list[tuple[float, str, int]] = []
    failing_until = 0.0
    peak = {"unacked": 0, "rss": 0.0}

    async def handler(delivery: Delivery) -> None:
        key, n = str(delivery.message_id).split("/")
        if key == "k0" and time.monotonic() < failing_until:
            raise RuntimeError("k0 fails")
        handled.append((time.monotonic(), key, int(n)))

    def watch() -> None:
        # unacked: what the consumer's channel holds (its ack book), sampled every 0.1 s
        while not stop_feed.is_set():
            book = consumer._core.io._book
            if book is not None:
                peak["unacked"] = max(peak["unacked"], book.held)
            peak["rss"] = max(peak["rss"], rss_mb())
            time.sleep(0.1)

    async def main() -> None:
        nonlocal failing_until
        run = asyncio.ensure_future(consumer.run(handler))
        await asyncio.sleep(10)  # warm: the others' rate without a failing key
        t0 = time.monotonic()
        failing_until = t0 + fail_seconds
        await asyncio.sleep(fail_seconds)
        await asyncio.sleep(10)
        consumer.stop()
        await run

    feeder = threading.Thread(target=feed, daemon=True)
    watcher = threading.Thread(target=watch, daemon=True)
    feeder.start()
    watcher.start()
    started = time.monotonic()
    try:
        asyncio.run(main())
    finally:
        stop_feed.set()
        feeder.join(60)
        watcher.join(10)
        drop(queue)
    t_fail = started + 10
    before = [h for h in handled if h[0] < t_fail and h[1] != "k0" and h[0] > started + 2]
    during = [h for h in handled if t_fail + 2 <= h[0] < t_fail + fail_seconds and h[1] != "k0"]
    r_before = len(before) / (t_fail - started - 2)
    r_during = len(during) / (fail_seconds - 2)
    k0 = [n for _, key, n in handled if key == "k0"]
    per_key: dict[str, list[int]] = defaultdict(list)
    for _, key, n in handled:
        per_key[key].append(n)
    out_of_order = sum(1 for seq in per_key.values() if seq != sorted(seq))
    print(
        f"part 2: {keys:,} keys at {rate:,} msg/s offered, key k0 failing for {fail_seconds:.0f} s"
    )
    print(
        f"  other keys before: {r_before:,.0f} msg/s, while k0 fails: {r_during:,.0f} msg/s "
        f"({r_during / r_before:.2f}x, target >= 0.8)"
    )
    print(
        f"  k0: {len(k0)} events handled, in order: {k0 == sorted(k0)}; keys out of order: "
        f"{out_of_order}; parked: {consumer.stats.parked:,}"
    )
    print(
        f"  most unacked seen: {peak['unacked']} (prefetch 200); largest RSS {peak['rss']:.0f} MB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fail-seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=int, default=2000, help="part 2's offered msg/s")
    parser.add_argument("--only", choices=("1", "2"))
    args = parser.parse_args(argv)
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])}")
    if args.only in (None, "1"):
        part1(args.count, args.keys, args.repeat)
    if args.only in (None, "2"):
        part2(args.keys, args.fail_seconds, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
