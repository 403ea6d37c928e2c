"""Client CPU per confirmed message: what bounds a producer where the broker is not the limit.

    bash scripts/dev.sh run python benchmarks/client_cpu.py                 # 100,000 x 12 B
    bash scripts/dev.sh run python benchmarks/client_cpu.py --size 1024 --repeat 5
    bash scripts/dev.sh run python benchmarks/client_cpu.py --gc-stats      # time in the GC too
    npm ci --prefix benchmarks/node    # for --node: without it, the Node row says MISSING
    bash scripts/dev.sh run python benchmarks/client_cpu.py --node --only \
        publish,many,async,async-many                                      # issue 47's rows
    git worktree add /tmp/before <commit> && \
    bash scripts/dev.sh run python benchmarks/client_cpu.py --compare /tmp/before/src

Each row publishes ``--count`` persistent messages to a fresh durable queue on the local broker
($AMQP_URL), waits for every confirm, and reports the process CPU time (``time.process_time()``:
every thread, the I/O thread included) divided by the confirmed messages, median of ``--repeat``
runs, the rows interleaved (each pass runs every row once), and the best run; with each, how
many times cheaper than Node's row it is (best against best, median against median). CPU per
message is far steadier than msgs/s on a shared machine.
Rows: ``Publisher.publish()`` in a loop, the same from ``--threads`` threads sharing one
Publisher, ``Publisher.publish_many()`` with ``--batch`` bodies a call, and the same two for
``AsyncPublisher``; with ``--spool``, ``publish()`` of both through ``spool=DIR`` (``persist()``
every 10,000: issue 21's measure, ``--only publish,async --spool`` for the side by side); each
with its rate (msgs/s, first publish to last confirm). ``--node`` adds the
issue's reference to every pass, Node amqplib's ``ConfirmChannel`` with 10,000 unconfirmed at
most (``benchmarks/node/confirm_cpu.js``), and each row's ratio to it; reported MISSING, loudly,
when node or amqplib is absent; ``--compare SRC`` adds the same rows measured with another
tree's package in a child process, so a change and its baseline are measured in one run.
``--consume`` prints the consuming side instead (issue 47): benchmarks/consume.py's rows with
Node amqplib's ``channel.consume`` + ack as the reference, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import pika

import reliable_amqp
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


#: the spool rows call persist() after every this many messages (issue 21's measure)
PERSIST_EVERY = 10_000


def spool_row(url: str, count: int, body: bytes, batch: int, threads: int = 1) -> Measured:
    """``sync_row`` through ``Publisher(spool=DIR)`` (a fresh spool in $TMPDIR), ``publish()``
    in a loop with ``persist()`` every 10,000 messages."""
    queue = _queue(url)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="ra-cpu-spool-") as directory,
            Publisher(url, spool=directory) as publisher,
        ):
            # it connects in the background: wait for it (as sync_row's `with` does) by
            # declaring the queue again
            publisher.declare_queue(queue)
            publish = publisher.publish
            wall, started = time.perf_counter(), time.process_time()
            for i in range(1, count + 1):
                publish("", queue, body)
                if not i % PERSIST_EVERY:
                    publisher.persist()
            assert publisher.persist() == 0
            assert publisher.flush() == 0
            spent, wall = time.process_time() - started, time.perf_counter() - wall
            assert publisher.stats().confirmed == count
    finally:
        _drop(url, queue)
    return spent, wall


def async_spool_row(url: str, count: int, body: bytes, batch: int, threads: int = 1) -> Measured:
    """``async_row`` through ``AsyncPublisher(spool=DIR)``, ``persist()`` every 10,000."""
    queue = _queue(url)

    async def run(directory: str) -> Measured:
        async with AsyncPublisher(url, spool=directory) as publisher:
            await publisher.declare_queue(queue)  # connected (see spool_row)
            publish = publisher.publish
            wall, started = time.perf_counter(), time.process_time()
            for i in range(1, count + 1):
                await publish("", queue, body)
                if not i % PERSIST_EVERY:
                    await publisher.persist()
            assert await publisher.persist() == 0
            assert await publisher.flush() == 0
            spent, wall = time.process_time() - started, time.perf_counter() - wall
            assert publisher.stats().confirmed == count
            return spent, wall

    try:
        with tempfile.TemporaryDirectory(prefix="ra-cpu-spool-") as directory:
            return asyncio.run(run(directory))
    finally:
        _drop(url, queue)


HERE = os.path.dirname(os.path.abspath(__file__))
NODE = os.path.join(HERE, "node")
#: --only names of the in-process rows
ROW_KEYS = ("publish", "threads", "many", "async", "async-many", "spool", "async-spool")


NODE_ROW = "Node amqplib ConfirmChannel"


def missing_node() -> str | None:
    """Why the Node reference row cannot run here, or None when it can."""
    if shutil.which("node") is None:
        return "no `node` on PATH"
    if not os.path.isdir(os.path.join(NODE, "node_modules", "amqplib")):
        return f"amqplib not installed: npm ci --prefix {os.path.relpath(NODE)}"
    return None


def node_row(url: str, count: int, size: int) -> Measured:
    """Node amqplib's ConfirmChannel (window 10,000), the issue's reference, in its own process."""
    out = subprocess.run(
        ["node", os.path.join(NODE, "confirm_cpu.js"), url, str(count), str(size), "10000"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    figures = json.loads(out)
    return figures["cpu_seconds"], figures["wall_seconds"]


def compare_row(src: str, only: str, args: argparse.Namespace) -> dict[str, Measured]:
    """The in-process rows ``only`` measured once with the package found in ``src`` (another
    checkout's ``src/``), in a child process, so two trees are compared pass by pass."""
    env = dict(os.environ, PYTHONPATH=src)
    command = [sys.executable, os.path.abspath(__file__), "--json", "--repeat", "1"]
    command += ["--only", only, "--count", str(args.count), "--size", str(args.size)]
    command += ["--batch", str(args.batch), "--threads", str(args.threads), "--url", args.url]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return {name: (cpu[0], wall[0]) for name, (cpu, wall) in json.loads(out).items()}


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
    parser.add_argument(
        "--only", default=",".join(ROW_KEYS[:5]), help=f"rows to run, of {','.join(ROW_KEYS)}"
    )
    parser.add_argument(
        "--spool",
        action="store_true",
        help="add the spool rows (spool, async-spool: publish() through spool=DIR, persist()\n"
        "every 10,000) to the rows --only names",
    )
    parser.add_argument(
        "--node",
        action="store_true",
        help="add Node amqplib's ConfirmChannel, the reference row, and each row's ratio to it\n"
        "(needs node and `npm ci --prefix benchmarks/node`; MISSING when either is absent)",
    )
    parser.add_argument(
        "--compare",
        metavar="SRC",
        help="add the same rows measured with the package in SRC (e.g. an older checkout's src/),\n"
        "in a child process, interleaved pass by pass",
    )
    parser.add_argument(
        "--json", action="store_true", help="print each row's (CPU seconds, wall seconds) as JSON"
    )
    parser.add_argument(
        "--consume",
        action="store_true",
        help="the consuming side instead (issue 47): benchmarks/consume.py's rows, Node amqplib\n"
        "channel.consume + ack, Consumer, AsyncConsumer concurrency=1 and 16, pika\n"
        "SelectConnection, aio-pika message.process(); CPU per message, best of --repeat\n"
        "alternating, ratio to Node (30,000 x --size B, prefetch 200, unless --count says)",
    )
    args = parser.parse_args()
    if args.consume:
        return consume_table(args)
    if args.count % args.batch or args.count % args.threads:
        parser.error("--count must be a multiple of --batch and of --threads")
    only = [key for key in args.only.split(",") if key]
    if args.spool:
        only += [key for key in ("spool", "async-spool") if key not in only]
    if unknown := set(only) - set(ROW_KEYS):
        parser.error(f"--only: unknown rows {sorted(unknown)}; known: {', '.join(ROW_KEYS)}")
    node_missing = missing_node() if args.node else None
    if node_missing:
        print(f"\n!!! {NODE_ROW}: MISSING ({node_missing}) !!!\n", file=sys.stderr)
    body = b"x" * args.size
    table: dict[str, tuple[str, Callable[[str, int, bytes, int, int], Measured], int, int]] = {
        "publish": ("Publisher.publish()", sync_row, 0, 1),
        "threads": (f"Publisher.publish(), {args.threads} threads", sync_row, 0, args.threads),
        "many": (f"Publisher.publish_many({args.batch})", sync_row, args.batch, 1),
        "async": ("AsyncPublisher.publish()", async_row, 0, 1),
        "async-many": (f"AsyncPublisher.publish_many({args.batch})", async_row, args.batch, 1),
        "spool": ("Publisher.publish(), spool, persist() every 10,000", spool_row, 0, 1),
        "async-spool": (
            "AsyncPublisher.publish(), spool, persist() every 10,000",
            async_spool_row,
            0,
            1,
        ),
    }
    if not hasattr(Publisher, "publish_many"):  # an older tree, measured for comparison
        only = [key for key in only if not table[key][2]]
    rows = {table[key][0]: table[key][1:] for key in only}
    print(f" measuring {os.path.dirname(reliable_amqp.__file__)}", file=sys.stderr)
    cpu: dict[str, list[float]] = {}
    rate: dict[str, list[float]] = {}
    in_gc: dict[str, list[float]] = {}
    spents: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}

    def record(name: str, spent: float, wall: float, gc_seconds: float | None = None) -> None:
        cpu.setdefault(name, []).append(spent / args.count * 1e6)
        rate.setdefault(name, []).append(args.count / wall)
        spents.setdefault(name, []).append(spent)
        walls.setdefault(name, []).append(wall)
        if gc_seconds is not None:
            in_gc.setdefault(name, []).append(gc_seconds / args.count * 1e6)
        print(f"  {name:<48} {cpu[name][-1]:6.2f} us/msg", file=sys.stderr)

    clock = GcClock()
    if args.gc_stats:
        gc.callbacks.append(clock)
    for n in range(args.repeat):
        print(f" pass {n + 1} of {args.repeat}", file=sys.stderr)
        for name, (row, batch, threads) in rows.items():
            clock.seconds = 0.0
            spent, wall = row(args.url, args.count, body, batch, threads)
            record(name, spent, wall, clock.seconds if args.gc_stats else None)
        if args.compare:
            for name, (spent, wall) in compare_row(args.compare, ",".join(only), args).items():
                record(f"[{args.compare}] {name}", spent, wall)
        if args.node and not node_missing:
            record(NODE_ROW, *node_row(args.url, args.count, args.size))
    if args.json:
        json.dump({name: (spents[name], walls[name]) for name in cpu}, sys.stdout)
        print()
        return 0
    print(
        f"\n== client CPU per confirmed message: {args.count:,} persistent x {args.size} B, "
        f"best and median of {args.repeat}, rows alternating =="
    )
    width = max(40, *(len(name) for name in cpu))
    header = f"{'row':<{width}} {'best':>6} {'median':>7} {'(min-max)':>13} {'msgs/s':>8}"
    header += f" {'vs Node (best)':>15} {'(median)':>9}"
    print(header + (f" {'in GC':>7}" if args.gc_stats else ""))
    node = cpu.get(NODE_ROW)
    for name, values in cpu.items():
        median = statistics.median(values)
        line = (
            f"{name:<{width}} {min(values):6.2f} {median:7.2f} "
            f"{f'{min(values):.2f}-{max(values):.2f}':>13} {statistics.median(rate[name]):>8,.0f}"
        )
        if node:  # how many times cheaper than Node per message (>1: cheaper)
            line += f" {min(node) / min(values):14.2f}x {statistics.median(node) / median:8.2f}x"
        elif node_missing:
            line += f" {'MISSING':>15} {'':>9}"
        if name in in_gc:
            line += f" {statistics.median(in_gc[name]):7.2f}"
        print(line)
    if node_missing:
        print(f"{NODE_ROW:<{width}} MISSING: {node_missing}")
        print("!!! no Node reference in this run: the ratios to Node are MISSING !!!")
    for line in spool_ratios({name: statistics.median(values) for name, values in cpu.items()}):
        print(line)
    return 0


def consume_table(args: argparse.Namespace) -> int:
    """``--consume``: the consume rows of ``benchmarks/consume.py`` (one process, the same
    clock: CPU from the first message handled to the last), best of ``--repeat``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import consume

    count = 30_000 if args.count == 100_000 else args.count
    argv = ["--only", consume.ISSUE_47, "--repeat", str(args.repeat), "--count", str(count)]
    argv += ["--size", str(args.size), "--url", args.url] + (["--json"] if args.json else [])
    return consume.main(argv)


#: each spool row's spool-less row (issue 21's budget: at most 1.8x its CPU per message)
SPOOL_BASE = {
    "Publisher.publish(), spool, persist() every 10,000": "Publisher.publish()",
    "AsyncPublisher.publish(), spool, persist() every 10,000": "AsyncPublisher.publish()",
}


def spool_ratios(medians: dict[str, float]) -> list[str]:
    """Each spool row's CPU per message against its publisher's without a spool, measured in
    the same run (a ``--compare`` tree's rows against that tree's)."""
    lines = []
    for name, median in medians.items():
        prefix, _, row = name.rpartition("] ")
        base = SPOOL_BASE.get(row or name)
        plain = medians.get(f"{prefix}] {base}" if prefix else str(base))
        if base is not None and plain:
            lines.append(f"  {name}: {median / plain:.2f}x the CPU of {base} without a spool")
    return lines


if __name__ == "__main__":
    sys.exit(main())
