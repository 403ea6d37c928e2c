"""What per-key order costs a consumer, and what one failing key costs the others (issue 46).

    bash scripts/dev.sh run python benchmarks/order.py                    # both parts
    bash scripts/dev.sh run python benchmarks/order.py --count 20000 --repeat 3 --fail-seconds 60

Part 1, cost: ``AsyncConsumer(concurrency=16)`` consumes ``--count`` messages spread over
``--keys`` keys (1,000), with ``key="header:entity"`` and without, alternating, ``--repeat``
times, in one run; each row's rate runs from the first message handled to the last. The ratio
keyed/unkeyed is printed (the issue's target: at least 0.8).

Part 2, one key failing: the same consumer with ``key=`` and handlers awaiting 5 ms of work,
over a backlog of ``--backlog`` messages on ``--keys`` keys (so it runs at its own top speed);
in one run no key fails, in the next key k0 fails for the first ``--fail-seconds`` (its retries
fail until then, its later events are parked behind it). The other keys' rate from 2 s to
``--fail-seconds`` is printed for both runs, with the most unacked messages the consumer's
channel held (sampled every 0.1 s) and the largest RSS; k0's events are checked to run in order.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid

import pika

from reliable_amqp import AsyncConsumer, Delivery, Publisher, RetryPolicy

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: what each handler awaits: 16 of them at once make at most 3,200 msg/s, so the backlog lasts
WORK = 0.005
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


def measured_consumer(queue: str, keyed: bool) -> AsyncConsumer:
    """The consumer both parts measure: 16 handlers at once, with or without ``key=``."""
    return AsyncConsumer(
        URL,
        queue,
        prefetch=200,
        concurrency=16,
        redelivery=POLICY,
        key="header:entity" if keyed else None,
    )


def consume_rate(count: int, keys: int, keyed: bool) -> float:
    queue = fresh_queue()
    try:
        fill(queue, count, keys)
        consumer = measured_consumer(queue, keyed)
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


def failing_run(
    keys: int, backlog: int, fail_seconds: float, keyed: bool, failing: bool
) -> tuple[float, list[int], int, int, float]:
    """One consumer over a backlog: the other keys' rate from 2 s to ``fail_seconds`` after
    the first message, k0's events, the parks, the most unacked, the largest RSS."""
    queue = fresh_queue()
    try:
        fill(queue, backlog, keys)
        consumer = measured_consumer(queue, keyed)
        handled: list[tuple[float, str, int]] = []
        first: list[float] = []
        peak = {"unacked": 0, "rss": 0.0}
        done = threading.Event()

        async def handler(delivery: Delivery) -> None:
            now = time.monotonic()
            if not first:
                first.append(now)
                asyncio.get_running_loop().call_later(fail_seconds + 1, consumer.stop)
            key, n = str(delivery.message_id).split("/")
            if failing and key == "k0" and now < first[0] + fail_seconds:
                raise RuntimeError("k0 fails")
            await asyncio.sleep(WORK)  # the handler's own work (a database write, say)
            handled.append((now, key, int(n)))

        def watch() -> None:  # unacked: what the channel holds (its ack book), every 0.1 s
            while not done.wait(0.1):
                peak["unacked"] = max(peak["unacked"], consumer._core.io.unacked)
                peak["rss"] = max(peak["rss"], rss_mb())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            asyncio.run(consumer.run(handler))
        finally:
            done.set()
            watcher.join(5)
        t0 = first[0]
        window = [h for h in handled if t0 + 2 <= h[0] < t0 + fail_seconds and h[1] != "k0"]
        rate = len(window) / (fail_seconds - 2)
        assert len(handled) < backlog, "the backlog ran out before the window ended: raise it"
        k0 = [n for _, key, n in handled if key == "k0"]
        return rate, k0, consumer.stats.parked, int(peak["unacked"]), peak["rss"]
    finally:
        drop(queue)


def part2(keys: int, fail_seconds: float, backlog: int) -> None:
    base, _, _, _, _ = failing_run(keys, backlog, fail_seconds, keyed=True, failing=False)
    rate, k0, parked, unacked, rss = failing_run(
        keys, backlog, fail_seconds, keyed=True, failing=True
    )
    print(
        f"part 2: a backlog of {backlog:,} over {keys:,} keys, AsyncConsumer(concurrency=16, "
        f"key=...), handlers of {WORK * 1000:.0f} ms; key k0 failing for its first "
        f"{fail_seconds:.0f} s"
    )
    print(
        f"  the other keys: {base:,.0f} msg/s with no key failing, {rate:,.0f} msg/s while k0 "
        f"fails ({rate / base:.2f}x, target >= 0.8)"
    )
    print(
        f"  k0: {len(k0)} events handled, in order: {k0 == sorted(k0)}; parks: {parked:,}; "
        f"most unacked: {unacked} (prefetch 200); largest RSS {rss:.0f} MB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fail-seconds", type=float, default=60.0)
    parser.add_argument("--backlog", type=int, default=300_000, help="part 2's messages")
    parser.add_argument("--only", choices=("1", "2"))
    args = parser.parse_args(argv)
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])}")
    if args.only in (None, "1"):
        part1(args.count, args.keys, args.repeat)
    if args.only in (None, "2"):
        part2(args.keys, args.fail_seconds, args.backlog)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
