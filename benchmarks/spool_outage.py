"""A long broker outage through the durable spool (issue 21): memory flat, everything delivered.

    bash scripts/dev.sh run python benchmarks/spool_outage.py                  # 5,000,000 x 1 KiB
    bash scripts/dev.sh run python benchmarks/spool_outage.py --count 1000000 --no-verify

A ``Publisher(spool=DIR)`` publishes ``--count`` distinct messages of ``--size`` bytes (futures
dropped) while the broker is unreachable: a TCP proxy in front of it refuses every connection.
RSS is reported every ``--report-every`` messages. Then the proxy lets connections through, the
same publisher drains the spool (timed: drain rate), the spool directory's size is reported as
it drains and after ``close()``, and the queue is read back to check that every message arrived
once, in order (``--no-verify`` skips that). A spool-less ``Publisher`` publishes
``--compare-count`` messages through the same proxy to a fresh queue in the same run: the drain
rate is reported beside its rate. Queues are lazy (the broker keeps the backlog on its disk).
``tests/faults/test_spool_faults.py`` runs :func:`outage` with 1,000,000 messages.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pika

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import contextlib

from harness.proxy import TcpProxy
from reliable_amqp import Publisher

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def rss() -> int:
    """The resident set size of this process, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def directory_bytes(directory: str) -> int:
    """Bytes the files of ``directory`` take (what is there now)."""
    total = 0
    for entry in os.scandir(directory):
        with contextlib.suppress(FileNotFoundError):
            total += entry.stat().st_size
    return total


def body(i: int, size: int) -> bytes:
    """The ``i``-th message's body: its number, then padding (distinct bodies, in order)."""
    head = b"%012d" % i
    return head + b"x" * (size - len(head))


@dataclass
class Outage:
    """What :func:`outage` measured."""

    count: int
    #: (messages published so far, RSS growth in bytes since the first of them)
    rss: list[tuple[int, int]] = field(default_factory=list)
    publish_seconds: float = 0.0
    #: the two longest publish() calls, in seconds (the longer last)
    slowest: list[float] = field(default_factory=lambda: [0.0, 0.0])
    spool_bytes_full: int = 0
    drain_seconds: float = 0.0
    drain_cpu: float = 0.0
    #: the spool directory's size sampled every second while it drained
    spool_bytes_draining: list[int] = field(default_factory=list)
    spool_bytes_after: int = 0

    @property
    def drain_rate(self) -> float:
        """Messages a second from the broker's return to the last confirm."""
        return self.count / self.drain_seconds


def fresh_queue(url: str) -> str:
    """A new durable lazy queue (the backlog goes to the broker's disk, not its memory)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    name = f"ra-outage-{uuid.uuid4().hex[:10]}"
    connection.channel().queue_declare(name, durable=True, arguments={"x-queue-mode": "lazy"})
    connection.close()
    return name


def drop_queue(url: str, queue: str) -> None:
    """Delete ``queue``."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_delete(queue)
    connection.close()


def outage(
    proxy: TcpProxy,
    queue: str,
    directory: str,
    *,
    count: int,
    size: int = 1024,
    report_every: int = 1_000_000,
    report: bool = True,
) -> Outage:
    """Publish ``count`` messages into a spool with ``proxy`` refusing, then let it through and
    drain; ``directory`` is the spool's."""
    result = Outage(count)
    proxy.refuse()
    # room for all of it: each message counts its body and its stored properties (~75 B)
    publisher = Publisher(proxy.url(), spool=directory, spool_max_bytes=count * (size + 128))
    try:
        publisher.connect()
        started = time.perf_counter()
        before = rss()
        slowest = result.slowest
        clock = time.perf_counter
        for i in range(count):
            called = clock()
            publisher.publish("", queue, body(i, size))  # the future is dropped
            took = clock() - called
            if took > slowest[0]:
                slowest[:] = sorted([took, slowest[1]])
            if (i + 1) % report_every == 0:
                result.rss.append((i + 1, rss() - before))
                if report:
                    print(
                        f"  {i + 1:>11,} spooled  RSS +{result.rss[-1][1] / 2**20:6.1f} MB  "
                        f"spool {directory_bytes(directory) / 2**20:8.0f} MB",
                        file=sys.stderr,
                    )
        publisher.persist()
        result.publish_seconds = time.perf_counter() - started
        result.spool_bytes_full = directory_bytes(directory)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                result.spool_bytes_draining.append(directory_bytes(directory))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proxy.accept()  # the broker is back
        started, cpu = time.perf_counter(), time.process_time()
        left = publisher.flush(None)
        result.drain_seconds = time.perf_counter() - started
        result.drain_cpu = time.process_time() - cpu
        done.set()
        sampler.join()
        if left:
            raise RuntimeError(f"{left:,} messages not confirmed after the drain")
    finally:
        publisher.close()
    result.spool_bytes_after = directory_bytes(directory)
    return result


def plain_rate(proxy: TcpProxy, queue: str, count: int, size: int) -> float:
    """Messages a second of a spool-less Publisher through ``proxy`` (first publish to last
    confirm)."""
    with Publisher(proxy.url()) as publisher:
        started = time.perf_counter()
        for i in range(count):
            publisher.publish("", queue, body(i, size))
        if publisher.flush(None):
            raise RuntimeError("the spool-less publisher left messages unconfirmed")
        return count / (time.perf_counter() - started)


def verify(url: str, queue: str, count: int, size: int) -> None:
    """Read ``queue`` back: ``count`` messages, each once, in order (raises otherwise)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=5000)
    expected = 0
    for method, _props, data in channel.consume(queue, inactivity_timeout=10):
        if method is None:
            break
        number = int(data[:12])
        if number < expected:  # a duplicate (at-least-once): allowed, skipped
            channel.basic_ack(method.delivery_tag)
            continue
        if number != expected or len(data) != size:
            raise AssertionError(f"message {number} arrived where {expected} was due")
        expected += 1
        if not expected % 5000 or expected == count:
            channel.basic_ack(method.delivery_tag, multiple=True)
        if expected == count:
            break
    channel.cancel()
    connection.close()
    if expected != count:
        raise AssertionError(f"{expected:,} of {count:,} messages arrived")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=URL, help="the broker (host and port are proxied)")
    parser.add_argument("--count", type=int, default=5_000_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--report-every", type=int, default=1_000_000)
    parser.add_argument("--compare-count", type=int, default=200_000)
    parser.add_argument("--no-verify", action="store_true")
    args = parser.parse_args()
    params = pika.URLParameters(args.url)
    queue, plain_queue = fresh_queue(args.url), fresh_queue(args.url)
    try:
        with (
            TcpProxy(params.port, params.host).start() as proxy,
            tempfile.TemporaryDirectory(prefix="ra-outage-") as directory,
        ):
            print(
                f"== {args.count:,} x {args.size} B through a spool, broker unreachable ==",
                file=sys.stderr,
            )
            result = outage(
                proxy, queue, directory, count=args.count, size=args.size,
                report_every=args.report_every,
            )  # fmt: skip
            plain = plain_rate(proxy, plain_queue, args.compare_count, args.size)
            if not args.no_verify:
                verify(args.url, queue, args.count, args.size)
        peak = max(growth for _, growth in result.rss)
        print(f"\n== spool outage: {args.count:,} x {args.size} B ==")
        print(f"RSS growth, every {args.report_every:,}: " + ", ".join(
            f"{n:,}: +{g / 2**20:.1f} MB" for n, g in result.rss
        ))  # fmt: skip
        print(f"RSS growth at most +{peak / 2**20:.1f} MB")
        print(
            f"longest publish() calls: {result.slowest[1] * 1000:.0f} ms (the window filled: "
            f"PACE_WAIT), then {result.slowest[0] * 1000:.0f} ms"
        )
        print(
            f"spooled in {result.publish_seconds:.1f} s "
            f"({args.count / result.publish_seconds:,.0f} msgs/s), spool "
            f"{result.spool_bytes_full / 2**20:,.0f} MB on disk"
        )
        shrinking = ", ".join(f"{b / 2**20:,.0f}" for b in result.spool_bytes_draining[::10])
        print(f"spool while draining (MB, every 10 s): {shrinking}")
        print(f"spool after close: {result.spool_bytes_after / 2**20:.2f} MB")
        print(
            f"drain: {result.drain_seconds:.1f} s, {result.drain_rate:,.0f} msgs/s, "
            f"{result.drain_cpu / args.count * 1e6:.1f} us client CPU a message; spool-less "
            f"publisher in the same run: {plain:,.0f} msgs/s; ratio "
            f"{result.drain_rate / plain:.2f}x"
        )
        print("order: " + ("not checked" if args.no_verify else "every message once, in order"))
    finally:
        drop_queue(args.url, queue)
        drop_queue(args.url, plain_queue)
    return 0


if __name__ == "__main__":
    sys.exit(main())
