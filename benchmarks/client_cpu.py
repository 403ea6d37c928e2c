"""Client CPU per confirmed message: what bounds a producer where the broker is not the limit.

    bash scripts/dev.sh run python benchmarks/client_cpu.py                 # 100,000 x 12 B
    bash scripts/dev.sh run python benchmarks/client_cpu.py --size 1024 --repeat 5
    bash scripts/dev.sh run python benchmarks/client_cpu.py --gc-stats      # time in the GC too

Each row publishes ``--count`` persistent messages to a fresh durable queue on the local broker
($AMQP_URL), waits for every confirm, and reports the process CPU time (``time.process_time()``:
every thread, the I/O thread included) divided by the confirmed messages, median of ``--repeat``
runs, the rows interleaved. CPU per message is far steadier than msgs/s on a shared machine.
Rows: ``Publisher.publish()`` in a loop, the same from ``--threads`` threads sharing one
Publisher, ``Publisher.publish_many()`` with ``--batch`` bodies a call, and the same two for
``AsyncPublisher``; each with its rate (msgs/s, first publish to last confirm).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable

import pika

from reliable_amqp import AsyncPublisher, Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: (client CPU seconds, wall seconds) of one run
Measured = tuple[float, float]


class GcClock:
    """Thread CPU time spent in the garbage collector (gc.callbacks), per run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started


def _queue(url: str) -> str:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    queue = f"ra-cpu-{uuid.uuid4().hex[:10]}"
    connection.channel().queue_declare(queue, durable=True)
    connection.close()
    return queue


def _drop(url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_delete(queue)
    connection.close()


def sync_row(url: str, count: int, body: bytes, batch: int, threads: int = 1) -> Measured:
    """CPU and wall seconds for ``count`` confirmed messages through one ``Publisher``,
    published by ``threads`` threads (each ``count / threads``)."""
    queue = _queue(url)
    try:
        with Publisher(url) as publisher:

            def produce(n: int) -> None:
                if batch:
                    bodies = [body] * batch
                    for _ in range(n // batch):
                        publisher.publish_many("", queue, bodies)
                else:
                    publish = publisher.publish
                    for _ in range(n):
                        publish("", queue, body)

            wall, started = time.perf_counter(), time.process_time()
            if threads == 1:
                produce(count)
            else:
                workers = [
                    threading.Thread(target=produce, args=(count // threads,))
                    for _ in range(threads)
                ]
                for worker in workers:
                    worker.start()
                for worker in workers:
                    worker.join()
            assert publisher.flush() == 0
            spent, wall = time.process_time() - started, time.perf_counter() - wall
            assert publisher.stats().confirmed == count
    finally:
        _drop(url, queue)
    return spent, wall


def async_row(url: str, count: int, body: bytes, batch: int, threads: int = 1) -> Measured:
    """CPU and wall seconds for ``count`` confirmed messages through ``AsyncPublisher``."""
    queue = _queue(url)

    async def run() -> Measured:
        async with AsyncPublisher(url) as publisher:
            wall, started = time.perf_counter(), time.process_time()
            if batch:
                bodies = [body] * batch
                for _ in range(count // batch):
                    await publisher.publish_many("", queue, bodies)
            else:
                publish = publisher.publish
                for _ in range(count):
                    await publish("", queue, body)
            assert await publisher.flush() == 0
            spent, wall = time.process_time() - started, time.perf_counter() - wall
            assert publisher.stats().confirmed == count
            return spent, wall

    try:
        return asyncio.run(run())
    finally:
        _drop(url, queue)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1000, help="bodies per publish_many() call")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gc-stats", action="store_true", help="also report time in the GC")
    parser.add_argument(
        "--threads", type=int, default=8, help="producer threads of the shared-Publisher row"
    )
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    if args.count % args.batch or args.count % args.threads:
        parser.error("--count must be a multiple of --batch and of --threads")
    body = b"x" * args.size
    rows: dict[str, tuple[Callable[[str, int, bytes, int, int], Measured], int, int]] = {
        "Publisher.publish()": (sync_row, 0, 1),
        f"Publisher.publish(), {args.threads} threads": (sync_row, 0, args.threads),
        f"Publisher.publish_many({args.batch})": (sync_row, args.batch, 1),
        "AsyncPublisher.publish()": (async_row, 0, 1),
        f"AsyncPublisher.publish_many({args.batch})": (async_row, args.batch, 1),
    }
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    rate: dict[str, list[float]] = {name: [] for name in rows}
    in_gc: dict[str, list[float]] = {name: [] for name in rows}
    clock = GcClock()
    if args.gc_stats:
        gc.callbacks.append(clock)
    for n in range(args.repeat):
        print(f" pass {n + 1} of {args.repeat}", file=sys.stderr)
        for name, (row, batch, threads) in rows.items():
            clock.seconds = 0.0
            spent, wall = row(args.url, args.count, body, batch, threads)
            cpu[name].append(spent / args.count * 1e6)
            rate[name].append(args.count / wall)
            in_gc[name].append(clock.seconds / args.count * 1e6)
            print(f"  {name:<40} {cpu[name][-1]:6.2f} us/msg", file=sys.stderr)
    print(
        f"\n== client CPU per confirmed message: {args.count:,} persistent x {args.size} B, "
        f"median of {args.repeat} =="
    )
    header = f"{'row':<40} {'us/msg':>7} {'(min-max)':>13} {'msgs/s':>8}"
    print(header + (f" {'in GC':>7}" if args.gc_stats else ""))
    for name in rows:
        values = cpu[name]
        line = (
            f"{name:<40} {statistics.median(values):7.2f} "
            f"{f'{min(values):.2f}-{max(values):.2f}':>13} {statistics.median(rate[name]):>8,.0f}"
        )
        if args.gc_stats:
            line += f" {statistics.median(in_gc[name]):7.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
