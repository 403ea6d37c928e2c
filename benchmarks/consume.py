"""The consume benchmark: every way of consuming with an ack per message, side by side in one run.

    bash scripts/dev.sh run python benchmarks/consume.py                 # 30,000 messages a row
    bash scripts/dev.sh run python benchmarks/consume.py --count 5000 --repeat 3
    bash scripts/dev.sh run python benchmarks/consume.py --issue47      # issue 47's table
    PYTHONPATH=/tmp/before/src bash scripts/dev.sh run python benchmarks/consume.py --issue47
                                               # the same rows with another tree's package
    npm ci --prefix benchmarks/node                                      # for the Node row

Each row consumes ``--count`` messages (12 B bodies by default) from a fresh durable queue of its
own, filled beforehand (untimed) with ``reliable_amqp.Publisher.publish_many`` and confirmed, with
``--prefetch`` (200) unacknowledged at most, and nothing done per message but the ack:

- ``pika BlockingConnection``: ``basic_consume`` + ``start_consuming``, ``basic_ack`` per message;
- ``pika SelectConnection``: the same on pika's callback-driven connection;
- ``aio-pika``: ``queue.consume()`` with ``async with message.process()`` per message;
- ``Node amqplib``: ``channel.consume`` with ``channel.ack`` per message, in a child process
  (``benchmarks/node/consume_cpu.js``); without node or amqplib the row is reported MISSING,
  loudly, never dropped in silence;
- ``reliable_amqp.Consumer``: a no-op handler, ``stop()`` at the count (acks batched by the
  library); ``reliable_amqp.AsyncConsumer``: a no-op async handler, ``concurrency=1`` and (row
  ``async-consumer-16``, with ``--issue47`` or ``--only``) ``concurrency=16``. These rows appear
  once the package has the classes (``--only`` picks rows).

The clock runs from the first message handled to the last (the ``count``-th): connecting,
subscribing, stopping and closing are not timed, and are the same few round trips for every
row. Acks still outstanding at the last message (this library batches them) are sent after;
every row then checks that its queue is empty, i.e. every message was acked. Client CPU per
message is this process's CPU time (``time.process_time()``, every thread) over the same span;
for Node, its own ``process.cpuUsage()`` over its timed span (the whole child process, start-up
included, is also shown in --json as ``child_cpu_us``). Every row starts only once the broker
is idle (``broker_idle.py``). The last lines are the ratios the issue asks for: ``Consumer``
against the faster of pika and aio-pika (target 2x), and against Node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import pika
import pika.channel
import pika.spec
from broker_idle import wait_idle

import reliable_amqp
from reliable_amqp import Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
COUNT = 30_000
PREFETCH = 200
NODE_DIR = Path(__file__).parent / "node"
NODE_SCRIPT = NODE_DIR / "consume_cpu.js"

Row = dict[str, Any]
#: a row: (url, queue, count, prefetch) -> (wall seconds, CPU seconds, extra fields)
Measure = Callable[[str, str, int, int], tuple[float, float, dict[str, Any]]]

PIKA_BLOCKING = "pika BlockingConnection basic_consume, ack each"
PIKA_SELECT = "pika SelectConnection basic_consume, ack each"
AIO_PIKA = "aio-pika queue.consume + message.process()"
NODE = "Node amqplib channel.consume, ack each"
CONSUMER = "reliable_amqp.Consumer (no-op handler)"
ASYNC_CONSUMER = "reliable_amqp.AsyncConsumer (no-op async handler)"
ASYNC_CONSUMER_16 = "reliable_amqp.AsyncConsumer concurrency=16 (no-op)"
#: the rows issue 47 compares, in one run (``--issue47``)
ISSUE_47 = "node,consumer,async-consumer,async-consumer-16,pika-select,aio-pika"


#: seconds a row may take before the run gives up on it, saying how far it got (a consumer that
#: stops short would otherwise wait forever: the test that runs every row sets it low)
ROW_TIMEOUT = float(os.environ.get("RELIABLE_AMQP_BENCH_ROW_TIMEOUT", "300"))


class Span:
    """Wall and CPU time from the first message handled to the ``count``-th."""

    #: the span of the row being measured, for the watchdog
    current: Span | None = None

    def __init__(self, count: int) -> None:
        self.count = count
        self.seen = 0
        self.wall = self.cpu = 0.0
        Span.current = self

    def tick(self) -> bool:
        """One message handled; True at the last one."""
        self.seen += 1
        if self.seen == 1:
            self.wall, self.cpu = time.perf_counter(), time.process_time()
        if self.seen == self.count:
            self.wall = time.perf_counter() - self.wall
            self.cpu = time.process_time() - self.cpu
            return True
        return False

    def result(self, name: str) -> tuple[float, float, Row]:
        if self.seen != self.count:
            raise RuntimeError(f"{name} handled {self.seen} of {self.count}")
        return self.wall, self.cpu, {}


class RowMissing(Exception):
    """A row that cannot run here (say why, loudly: a comparison row is never skipped in
    silence)."""


@contextmanager
def filled_queue(url: str, count: int, body: bytes) -> Iterator[str]:
    """A fresh durable queue holding ``count`` confirmed messages; deleted afterwards."""
    queue = f"ra-bench-consume-{uuid.uuid4().hex[:10]}"
    with Publisher(url) as publisher:
        publisher.declare_queue(queue, durable=True)
        futures = []
        for start in range(0, count, 1_000):
            futures += publisher.publish_many("", queue, [body] * min(1_000, count - start))
        left = publisher.flush(timeout=120)
    failed = sum(1 for f in futures if f.exception() is not None)
    if left or failed:
        raise RuntimeError(f"filling {queue}: {failed} failed, {left} unconfirmed of {count}")
    try:
        yield queue
    finally:
        connection = pika.BlockingConnection(pika.URLParameters(url))
        try:
            connection.channel().queue_delete(queue)
        finally:
            connection.close()


def ready(url: str, queue: str) -> int:
    """Messages ready in ``queue`` (unacked ones of a closed connection are ready again)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


# --- the rows --------------------------------------------------------------------------------


def pika_blocking(url: str, queue: str, count: int, prefetch: int) -> tuple[float, float, Row]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    span = Span(count)

    def on_message(
        ch: Any, method: pika.spec.Basic.Deliver, _props: pika.BasicProperties, _body: bytes
    ) -> None:
        ch.basic_ack(method.delivery_tag)
        if span.tick():
            ch.stop_consuming()

    channel.basic_consume(queue, on_message)
    channel.start_consuming()
    connection.close()
    return span.result("pika BlockingConnection")


def pika_select(url: str, queue: str, count: int, prefetch: int) -> tuple[float, float, Row]:
    span = Span(count)
    failure: list[BaseException | str] = []

    def on_open(connection: pika.SelectConnection) -> None:
        connection.channel(on_open_callback=on_channel)

    def on_channel(channel: pika.channel.Channel) -> None:
        channel.basic_qos(
            prefetch_count=prefetch,
            callback=lambda _frame: channel.basic_consume(queue, on_message),
        )

    def on_message(
        channel: pika.channel.Channel,
        method: pika.spec.Basic.Deliver,
        _props: pika.BasicProperties,
        _body: bytes,
    ) -> None:
        channel.basic_ack(method.delivery_tag)
        if span.tick():
            channel.connection.close()

    def on_failed(connection: Any, error: BaseException) -> None:
        failure.append(error)
        connection.ioloop.stop()

    connection = pika.SelectConnection(
        pika.URLParameters(url),
        on_open_callback=on_open,
        on_open_error_callback=on_failed,
        on_close_callback=lambda conn, _reason: conn.ioloop.stop(),
    )
    connection.ioloop.start()
    if failure:
        raise RuntimeError(f"pika SelectConnection: {failure}")
    return span.result("pika SelectConnection")


def aio_pika_process(url: str, queue: str, count: int, prefetch: int) -> tuple[float, float, Row]:
    import aio_pika
    import aio_pika.abc

    span = Span(count)

    async def run() -> None:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            source = await channel.get_queue(queue, ensure=False)
            done = asyncio.Event()

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                async with message.process():
                    pass
                if span.tick():
                    done.set()

            tag = await source.consume(on_message)
            await done.wait()
            await source.cancel(tag)

    asyncio.run(run())
    return span.result("aio-pika")


def node_amqplib(url: str, queue: str, count: int, prefetch: int) -> tuple[float, float, Row]:
    node = _node()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(
        [node, str(NODE_SCRIPT), url, queue, str(count), str(prefetch)],
        capture_output=True,
        text=True,
        timeout=ROW_TIMEOUT,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise RuntimeError(f"node consume_cpu.js failed ({result.returncode}): {result.stderr}")
    figures = json.loads(result.stdout)
    if figures["consumed"] != count:
        raise RuntimeError(f"node consumed {figures['consumed']} of {count}")
    child = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return figures["wall_seconds"], figures["cpu_seconds"], {"child_cpu_us": child / count * 1e6}


def _node() -> str:
    """The node executable, if node and amqplib are installed; else RowMissing saying so."""
    node = shutil.which("node")
    if node is None:
        raise RowMissing("node is not installed (apt-get install nodejs)")
    if not (NODE_DIR / "node_modules" / "amqplib").is_dir():
        raise RowMissing(f"amqplib is not installed: npm ci --prefix {NODE_DIR}")
    return node


def _consumer_class(name: str) -> Any:
    cls = getattr(reliable_amqp, name, None)
    if cls is None:
        raise RowMissing(f"reliable_amqp.{name} does not exist in this tree")
    return cls


def _drop_own_queues(url: str, consumer: Any) -> None:
    """Delete the queues a consumer declared for itself (its dead letters, its delay queues):
    the broker is shared, and every row would leave seven more."""
    own = getattr(consumer.options, "own_queues", None)
    names = own() if callable(own) else own or ()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for name in names:
            channel.queue_delete(name)
    finally:
        connection.close()


def reliable_consumer(url: str, queue: str, count: int, prefetch: int) -> tuple[float, float, Row]:
    consumer = _consumer_class("Consumer")(url, queue, prefetch=prefetch)
    span = Span(count)

    def handler(_delivery: Any) -> None:
        if span.tick():
            consumer.stop()

    try:
        with consumer:
            consumer.run(handler)
    finally:
        _drop_own_queues(url, consumer)
    return span.result("Consumer")


def reliable_async_consumer(
    url: str, queue: str, count: int, prefetch: int, concurrency: int = 1
) -> tuple[float, float, Row]:
    cls = _consumer_class("AsyncConsumer")
    span = Span(count)

    consumer = cls(url, queue, prefetch=prefetch, concurrency=concurrency)

    async def handler(_delivery: Any) -> None:
        if span.tick():
            consumer.stop()

    try:
        asyncio.run(consumer.run(handler))
    finally:
        _drop_own_queues(url, consumer)
    return span.result("AsyncConsumer")


def reliable_async_consumer_16(
    url: str, queue: str, count: int, prefetch: int
) -> tuple[float, float, Row]:
    return reliable_async_consumer(url, queue, count, prefetch, concurrency=16)


#: --only key -> (row name, measure), in table order
ROWS: dict[str, tuple[str, Measure]] = {
    "pika-blocking": (PIKA_BLOCKING, pika_blocking),
    "pika-select": (PIKA_SELECT, pika_select),
    "aio-pika": (AIO_PIKA, aio_pika_process),
    "node": (NODE, node_amqplib),
    "consumer": (CONSUMER, reliable_consumer),
    "async-consumer": (ASYNC_CONSUMER, reliable_async_consumer),
    "async-consumer-16": (ASYNC_CONSUMER_16, reliable_async_consumer_16),
}
#: the rows a run has unless --only says (async-consumer-16 with --issue47 or --only)
DEFAULT_ROWS = list(ROWS)  # every row, AsyncConsumer at concurrency 1 and 16 included


@contextmanager
def watchdog(name: str) -> Iterator[None]:
    """Exit the run (status 3) if the row takes longer than ROW_TIMEOUT, saying how far it got;
    a little later than the Node row's own subprocess timeout, which ends that child first."""

    def expire() -> None:
        seen = Span.current.seen if Span.current is not None else 0
        print(
            f"consume.py: row {name!r} stuck: {seen} messages handled after {ROW_TIMEOUT:g} s",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    Span.current = None
    timer = threading.Timer(ROW_TIMEOUT + 10, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def measure(url: str, key: str, count: int, body: bytes, prefetch: int) -> Row | tuple[str, str]:
    """One row: fill its queue, wait for an idle broker, consume; a row, or (name, why not)."""
    name, fn = ROWS[key]
    try:
        if key.startswith(("consumer", "async-consumer")):
            _consumer_class("Consumer" if key == "consumer" else "AsyncConsumer")
        if key == "node":  # checked before filling a queue it cannot consume
            _node()
        with filled_queue(url, count, body) as queue:
            wait_idle()
            with watchdog(name):
                seconds, cpu, extra = fn(url, queue, count, prefetch)
            left = ready(url, queue)
    except RowMissing as exc:
        return name, str(exc)
    if left:
        raise RuntimeError(f"{name}: {left} messages left in the queue (not acked)")
    return {
        "name": name,
        "msgs": count,
        "body_bytes": len(body),
        "prefetch": prefetch,
        "seconds": seconds,
        "rate": count / seconds,
        "cpu_us": cpu / count * 1e6,
        **extra,
    }


def ratios(rows: list[Row]) -> list[str]:
    """The comparisons the issue asks for, computed within this run."""
    by_name = {r["name"]: r for r in rows}
    lines = []
    python_rows = [by_name[n] for n in (PIKA_BLOCKING, PIKA_SELECT, AIO_PIKA) if n in by_name]
    best = max(python_rows, key=lambda r: r["rate"], default=None)
    for ours in (CONSUMER, ASYNC_CONSUMER, ASYNC_CONSUMER_16):
        if ours not in by_name:
            continue
        mine = by_name[ours]
        short = ours.split(" (")[0]
        if best is not None:
            lines.append(
                f"  {short}: {mine['rate'] / best['rate']:.2f}x the faster of pika and aio-pika "
                f"({best['name']}){'  (target >= 2x)' if ours == CONSUMER else ''}"
            )
        if ours != CONSUMER and AIO_PIKA in by_name:
            lines.append(f"  {short}: {mine['rate'] / by_name[AIO_PIKA]['rate']:.2f}x aio-pika")
        if NODE in by_name:
            node = by_name[NODE]
            lines.append(
                f"  {short}: {mine['rate'] / node['rate']:.2f}x Node amqplib's rate, "
                f"{mine['cpu_us'] / node['cpu_us']:.2f}x its CPU per message"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--count", type=int, default=COUNT, help="messages per row")
    parser.add_argument("--size", type=int, default=12, help="body size in bytes")
    parser.add_argument("--prefetch", type=int, default=PREFETCH)
    parser.add_argument("--repeat", type=int, default=1, help="passes, rows alternating")
    parser.add_argument("--only", default=",".join(DEFAULT_ROWS), help=f"rows: {','.join(ROWS)}")
    parser.add_argument(
        "--issue47",
        action="store_true",
        help=f"issue 47's table: --only {ISSUE_47} --repeat 3 (unless given)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args(argv)
    if args.issue47:
        if args.only == ",".join(DEFAULT_ROWS):
            args.only = ISSUE_47
        if args.repeat == 1:
            args.repeat = 3
    keys = args.only.split(",")
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown} (known: {','.join(ROWS)})")
    rows = run(args.url, keys, args.count, args.size, prefetch=args.prefetch, repeat=args.repeat)
    if args.json:  # a row that could not run is there too, with the reason
        missing = [{"name": name, "missing": why} for name, why in MISSING.items()]
        print(json.dumps(rows + missing, indent=2))
    else:
        print(
            table(
                rows, count=args.count, size=args.size, prefetch=args.prefetch, repeat=args.repeat
            )
        )
    return 0


MISSING: dict[str, str] = {}


def run(
    url: str, keys: list[str], count: int, size: int, *, prefetch: int, repeat: int
) -> list[Row]:
    """``repeat`` passes over the rows ``keys`` (interleaved); each row's median, and its
    best pass (the least CPU per message: ``best_cpu_us``, with that pass's rate)."""
    body = b"x" * size
    runs: dict[str, list[Row]] = {}
    for n in range(repeat):
        print(f" pass {n + 1} of {repeat}", file=sys.stderr)
        for key in keys:
            got = measure(url, key, count, body, prefetch)
            if isinstance(got, tuple):
                name, why = got
                MISSING[name] = why
                print(f"  MISSING ROW {name}: {why}", file=sys.stderr)
                continue
            runs.setdefault(got["name"], []).append(got)
            print(
                f"  {got['name']:<52} {got['rate']:>9,.0f} msgs/s {got['cpu_us']:7.1f} us/msg",
                file=sys.stderr,
            )
    rows = []
    for results in runs.values():
        rates = sorted(r["rate"] for r in results)
        best = min(results, key=lambda r: r["cpu_us"])
        row = dict(results[0])
        row["rate"] = statistics.median(rates)
        row["runs"] = rates
        row["cpu_runs"] = [r["cpu_us"] for r in results]
        row["cpu_us"] = statistics.median(r["cpu_us"] for r in results)
        row["best_cpu_us"] = best["cpu_us"]
        row["best_rate"] = best["rate"]
        if "child_cpu_us" in row:
            row["child_cpu_us"] = statistics.median(r["child_cpu_us"] for r in results)
        rows.append(row)
    node = next((r for r in rows if r["name"] == NODE), None)
    for row in rows:  # Node's CPU per message over this row's, best pass against best pass
        if node is not None:
            row["vs_node"] = node["best_cpu_us"] / row["best_cpu_us"]
    return rows


def table(rows: list[Row], *, count: int, size: int, prefetch: int, repeat: int) -> str:
    """The rows, the rows that could not run (and why), and the ratios."""
    lines = [
        f"== consume {count:,} messages of {size} B, prefetch {prefetch}, ack after each, "
        f"{repeat} pass(es) alternating: median and best (least CPU per message) ==",
        f"{'row':<52} {'msgs/s':>9} {'(min-max)':>15} {'CPU/msg':>9} {'best':>8} "
        f"{'best msgs/s':>11} {'vs Node':>8}",
    ]
    for r in rows:
        spread = f"{min(r['runs']) / 1000:.1f}k-{max(r['runs']) / 1000:.1f}k"
        versus = f"{r['vs_node']:.2f}x" if "vs_node" in r else "-"
        lines.append(
            f"{r['name']:<52} {r['rate']:>9,.0f} {spread:>15} {r['cpu_us']:>6.1f} us "
            f"{r['best_cpu_us']:>5.1f} us {r['best_rate']:>11,.0f} {versus:>8}"
        )
    for name, why in MISSING.items():
        lines.append(f"{name:<52} MISSING: {why}")
    lines.append(
        "  vs Node: Node amqplib's CPU per message over the row's (best passes): 1.00x or more "
        "is as cheap as Node or cheaper"
    )
    lines += ratios(rows)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
