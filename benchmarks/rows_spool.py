"""Benchmark rows of the durable spool: both publishers with ``spool=DIR``, ``persist()`` every
10,000 messages (issue 14 asks for at least half the spool-less rate, 12 B and 1 KiB bodies).

    python benchmarks/rows_spool.py                 # 20,000 messages, 12 B and 1 KiB bodies
    python benchmarks/rows_spool.py --count 5000 --repeat 3

Standalone, it runs the spool-less ``Publisher`` row of ``rows_sync`` and ``AsyncPublisher`` row
of ``rows_async`` beside its own rows and prints each spool row's rate against its own
publisher's spool-less rate. ``benchmarks/run.py`` takes the rows from :func:`rows` (same shape as
``rows_async.rows``). Each row publishes to a fresh durable queue through a fresh spool in a
temporary directory, on the local disk (``$TMPDIR``), timed from the first publish to the last
confirm, ``persist()`` calls included; every future is checked and the spool must end empty.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import rows_async
from rows_sync import Row, _row, fresh_queue, reliable_publisher

from reliable_amqp import Publisher
from reliable_amqp._spool import inspect

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: persist() after every this many messages
PERSIST_EVERY = 10_000
SYNC_NAME = f"reliable_amqp.Publisher + spool (persist every {PERSIST_EVERY:,})"
ASYNC_NAME = f"reliable_amqp.AsyncPublisher + spool (persist every {PERSIST_EVERY:,})"


def spooled_publisher(url: str, count: int, body: bytes) -> Row:
    """Publisher(spool=DIR): every message through the spool, persist() every 10,000."""
    with (
        tempfile.TemporaryDirectory(prefix="ra-bench-spool-") as directory,
        fresh_queue(url) as (_connection, queue),
    ):
        with Publisher(url, spool=directory) as publisher:
            # a spooled publisher connects in the background: wait for it, as the spool-less
            # row's `with` does, by declaring the (existing) queue again
            publisher.declare_queue(queue)
            publish = publisher.publish
            started, cpu = time.perf_counter(), time.process_time()
            futures = []
            for i in range(count):
                futures.append(publish("", queue, body))
                if (i + 1) % PERSIST_EVERY == 0:
                    publisher.persist()
            publisher.persist()
            left = publisher.flush(timeout=120)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            confirmed = sum(1 for f in futures if f.exception() is None)
        pending = inspect(directory).pending
    if left or confirmed != count or pending:
        raise RuntimeError(
            f"spooled Publisher confirmed {confirmed} of {count} ({left} unresolved, "
            f"{pending} left in the spool)"
        )
    return _row(SYNC_NAME, count, seconds, cpu)


def spooled_async_publisher(url: str, count: int, body: bytes) -> Row:
    """AsyncPublisher(spool=DIR): every message through the spool, persist() every 10,000."""
    from reliable_amqp import AsyncPublisher

    async def run(directory: str, queue: str) -> tuple[float, float, int, int]:
        async with AsyncPublisher(url, spool=directory) as publisher:
            await publisher.declare_queue(queue)  # connected (see spooled_publisher)
            started, cpu = time.perf_counter(), time.process_time()
            futures = []
            for i in range(count):
                futures.append(await publisher.publish("", queue, body))
                if (i + 1) % PERSIST_EVERY == 0:
                    await publisher.persist()
            await publisher.persist()
            left = await publisher.flush(timeout=120)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            confirmed = sum(1 for f in futures if f.done() and f.exception() is None)
        return seconds, cpu, left, confirmed

    with (
        tempfile.TemporaryDirectory(prefix="ra-bench-spool-") as directory,
        fresh_queue(url) as (_connection, queue),
    ):
        seconds, cpu, left, confirmed = asyncio.run(run(directory, queue))
        pending = inspect(directory).pending
    if left or confirmed != count or pending:
        raise RuntimeError(
            f"spooled AsyncPublisher confirmed {confirmed} of {count} ({left} unresolved, "
            f"{pending} left in the spool)"
        )
    return _row(ASYNC_NAME, count, seconds, cpu)


def rows(url: str, count: int, body: bytes) -> list[Row]:
    """The spool rows, for ``benchmarks/run.py`` (group ``spool``)."""
    return [spooled_publisher(url, count, body), spooled_async_publisher(url, count, body)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--sizes", default="12,1024", help="body sizes in bytes")
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        body = b"x" * size
        runs: dict[str, list[float]] = {}
        for _ in range(args.repeat):  # passes interleaved, as in run.py
            for row in [
                reliable_publisher(args.url, args.count, body),
                asyncio.run(rows_async.async_publisher(args.url, args.count, body)),
                *rows(args.url, args.count, body),
            ]:
                runs.setdefault(str(row["name"]), []).append(float(row["rate"]))
        medians: dict[str, Any] = {name: statistics.median(r) for name, r in runs.items()}
        names = list(medians)
        # each spool row against its own publisher's spool-less row, measured beside it
        base = {names[0]: names[0], names[1]: names[1], SYNC_NAME: names[0], ASYNC_NAME: names[1]}
        print(f"\n== {args.count:,} messages, {size} B bodies ==")
        for name, rate in medians.items():
            print(f"{name:<60} {rate:>10,.0f} msgs/s {rate / medians[base[name]]:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
