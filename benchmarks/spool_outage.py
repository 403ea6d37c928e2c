"""A long broker outage through the durable spool (issue 21): memory flat, everything delivered.

    bash scripts/dev.sh run python benchmarks/spool_outage.py                  # 5,000,000 x 1 KiB
    bash scripts/dev.sh run python benchmarks/spool_outage.py --count 1000000 --no-verify

A ``Publisher(spool=DIR)`` publishes ``--count`` distinct messages of ``--size`` bytes (futures
dropped) while the broker is unreachable: a TCP proxy in front of it refuses every connection.
RSS is reported every ``--report-every`` messages. Then the proxy lets connections through, the
same publisher drains the spool (timed from its reconnection to the last confirm: drain rate;
the wait for the reconnection, up to the connect policy's 5 s backoff, is reported apart), the
spool directory's size and RSS are reported as it drains, the directory's size after
``close()``, and the queue is read back to check that every message arrived, in order
(duplicates, which at-least-once allows, are counted; ``--no-verify`` skips that). A spool-less
``Publisher`` publishes ``--compare-count`` messages through the same proxy to a fresh queue,
once before the outage and once after the drain, and then into the queue the drain filled
(behind its messages, where the broker's work per message is the drain's): the drain rate is
reported beside the three rates,
with the CPU a message each took here and, when one local ``beam.smp`` can be seen (psutil), in
the broker (on a small machine the broker's CPU is what bounds both rates). Queues are lazy (the
broker keeps the backlog on its disk).
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
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import contextlib

from harness.proxy import TcpProxy
from reliable_amqp import EventKind, Publisher, PublisherEvent

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def rss() -> int:
    """The resident set size of this process, in bytes."""
    return int(psutil.Process().memory_info().rss)


def broker_cpu() -> float | None:
    """CPU seconds the local broker has used so far: the one ``beam.smp`` process (None when
    there is none, or more than one: another node, say, that could not be told apart)."""
    found = []
    for process in psutil.process_iter(["name"]):
        if process.info["name"] != "beam.smp":
            continue
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone since
            continue
        found.append(times.user + times.system)
    return found[0] if len(found) == 1 else None


def broker_cpu_since(before: float | None) -> float | None:
    """The broker's CPU seconds since ``before`` (:func:`broker_cpu`), None when unknown."""
    now = broker_cpu()
    return None if before is None or now is None else now - before


def per_message(seconds: float | None, count: int) -> str:
    """Microseconds a message, or a dash when not measured."""
    return "-" if seconds is None else f"{seconds / count * 1e6:.1f} us"


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
    #: from the broker's return (the proxy accepting) to the publisher's reconnection
    reconnect_seconds: float = 0.0
    #: from the reconnection to the last confirm
    drain_seconds: float = 0.0
    #: client CPU (every thread of the process) from the broker's return to the last confirm
    drain_cpu: float = 0.0
    #: the broker's CPU meanwhile (None: not measured, see :func:`broker_cpu`)
    drain_broker_cpu: float | None = None
    #: the spool directory's size sampled every second while it drained
    spool_bytes_draining: list[int] = field(default_factory=list)
    #: RSS growth (since the first publish) sampled every second while it drained
    rss_draining: list[int] = field(default_factory=list)
    #: messages in flight (sent, not confirmed: ``Publisher.in_flight``) sampled every 0.1 s
    #: while it drained: a full window means the broker set the pace, not this process
    in_flight_draining: list[int] = field(default_factory=list)
    spool_bytes_after: int = 0

    @property
    def drain_rate(self) -> float:
        """Messages a second from the publisher's reconnection to the last confirm."""
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
    connected: list[float] = []  # time.monotonic() of each CONNECTED/RECOVERED event

    def on_event(event: PublisherEvent) -> None:
        if event.kind in (EventKind.CONNECTED, EventKind.RECOVERED):
            connected.append(event.at)

    # room for all of it: each message counts its body and its stored properties (~75 B)
    publisher = Publisher(
        proxy.url(), spool=directory, spool_max_bytes=count * (size + 128), on_event=on_event
    )
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
            ticks = 0
            while not done.wait(0.1):
                result.in_flight_draining.append(publisher.in_flight)
                ticks += 1
                if ticks % 10 == 0:
                    result.spool_bytes_draining.append(directory_bytes(directory))
                    result.rss_draining.append(rss() - before)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proxy.accept()  # the broker is back
        back, cpu, broker = time.monotonic(), time.process_time(), broker_cpu()
        left = publisher.flush(None)
        finished = time.monotonic()
        result.drain_cpu = time.process_time() - cpu
        result.drain_broker_cpu = broker_cpu_since(broker)
        if not connected:
            raise RuntimeError("the spool drained without a CONNECTED event")
        result.reconnect_seconds = connected[0] - back
        result.drain_seconds = finished - connected[0]
        done.set()
        sampler.join()
        if left:
            raise RuntimeError(f"{left:,} messages not confirmed after the drain")
    finally:
        publisher.close()
    result.spool_bytes_after = directory_bytes(directory)
    return result


@dataclass
class Plain:
    """What :func:`plain_rate` measured."""

    rate: float
    #: this process's CPU seconds (the proxy's thread included, as in the drain's figure)
    cpu: float
    #: the broker's CPU seconds (None: not measured)
    broker_cpu: float | None
    #: messages in flight, sampled every 0.1 s
    in_flight: list[int]


def plain_rate(proxy: TcpProxy, queue: str, count: int, size: int, first: int = 0) -> Plain:
    """Messages a second of a spool-less Publisher through ``proxy`` (first publish to last
    confirm), and the CPU it took; its bodies are numbered from ``first``."""
    in_flight: list[int] = []
    done = threading.Event()
    with Publisher(proxy.url()) as publisher:

        def sample() -> None:
            while not done.wait(0.1):
                in_flight.append(publisher.in_flight)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started, cpu, broker = time.perf_counter(), time.process_time(), broker_cpu()
        for i in range(first, first + count):
            publisher.publish("", queue, body(i, size))
        left = publisher.flush(None)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        broker_seconds = broker_cpu_since(broker)
        done.set()
        sampler.join()
        if left:
            raise RuntimeError("the spool-less publisher left messages unconfirmed")
        return Plain(count / seconds, cpu, broker_seconds, in_flight)


def mean(values: list[int]) -> float:
    """The mean of ``values`` (0 for none)."""
    return sum(values) / len(values) if values else 0.0


def verify(url: str, queue: str, count: int, size: int) -> int:
    """Read ``queue`` back: ``count`` messages in order (raises otherwise); returns how many
    duplicates (a message again, after it) were skipped."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=5000)
    expected = duplicates = 0
    for method, _props, data in channel.consume(queue, inactivity_timeout=10):
        if method is None:
            break
        number = int(data[:12])
        if number < expected:  # a duplicate (at-least-once): allowed, skipped
            channel.basic_ack(method.delivery_tag)
            duplicates += 1
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
    return duplicates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=URL, help="the broker (host and port are proxied)")
    parser.add_argument(
        "--count", type=int, default=5_000_000, help="messages spooled (default 5,000,000)"
    )
    parser.add_argument("--size", type=int, default=1024, help="body bytes (default 1024)")
    parser.add_argument(
        "--report-every", type=int, default=1_000_000, help="RSS every N messages (1,000,000)"
    )
    parser.add_argument(
        "--compare-count",
        type=int,
        default=200_000,
        help="messages of the spool-less publisher, before and after (default 200,000)",
    )
    parser.add_argument(
        "--no-verify", action="store_true", help="do not read the queue back (order, count)"
    )
    args = parser.parse_args()
    params = pika.URLParameters(args.url)
    queue, plain_queue = fresh_queue(args.url), fresh_queue(args.url)
    try:
        with (
            TcpProxy(params.port, params.host).start() as proxy,
            tempfile.TemporaryDirectory(prefix="ra-outage-") as directory,
        ):
            before = plain_rate(proxy, plain_queue, args.compare_count, args.size)
            print(
                f"== {args.count:,} x {args.size} B through a spool, broker unreachable "
                f"(spool-less publisher before: {before.rate:,.0f} msgs/s) ==",
                file=sys.stderr,
            )
            result = outage(
                proxy, queue, directory, count=args.count, size=args.size,
                report_every=args.report_every,
            )  # fmt: skip
            after = plain_rate(proxy, plain_queue, args.compare_count, args.size)
            # and into the queue the drain filled, behind its messages (numbered after them):
            # the broker's work per message grows with a queue that deep
            deep = plain_rate(proxy, queue, args.compare_count, args.size, first=args.count)
            duplicates = None
            if not args.no_verify:
                duplicates = verify(args.url, queue, args.count + args.compare_count, args.size)
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
        rss_drain = ", ".join(f"{g / 2**20:+.1f}" for g in result.rss_draining[::10])
        print(f"RSS growth while draining (MB, every 10 s): {rss_drain}")
        print(f"spool after close: {result.spool_bytes_after / 2**20:.2f} MB")
        print(
            f"drain: reconnected {result.reconnect_seconds:.1f} s after the broker came back "
            f"(backoff), then {result.drain_seconds:.1f} s to the last confirm: "
            f"{result.drain_rate:,.0f} msgs/s; CPU a message: "
            f"{per_message(result.drain_cpu, args.count)} here (publisher and proxy threads), "
            f"{per_message(result.drain_broker_cpu, args.count)} the broker; "
            f"{mean(result.in_flight_draining):,.0f} in flight on average"
        )
        n = args.compare_count
        for when, plain in (
            ("before the outage", before),
            ("after the drain", after),
            (f"into the drained queue, behind its {args.count:,}", deep),
        ):
            print(
                f"spool-less publisher {when} ({n:,} messages, same proxy): "
                f"{plain.rate:,.0f} msgs/s; CPU a message: {per_message(plain.cpu, n)} here, "
                f"{per_message(plain.broker_cpu, n)} the broker; "
                f"{mean(plain.in_flight):,.0f} in flight on average; drain rate "
                f"{result.drain_rate / plain.rate:.2f}x of it"
            )
        if duplicates is None:
            print("order: not checked")
        else:
            total = args.count + args.compare_count
            print(
                f"order: all {args.count:,} arrived, in order, and the {args.compare_count:,} "
                f"published after them ({total:,}); {duplicates:,} duplicates"
            )
    finally:
        drop_queue(args.url, queue)
        drop_queue(args.url, plain_queue)
    return 0


if __name__ == "__main__":
    sys.exit(main())
