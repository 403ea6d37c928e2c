"""Soak: a long confirmed stream with a fault every few seconds, then a full accounting.

    bash scripts/dev.sh run python benchmarks/soak.py --seconds 60 --fault-every 5

A disposable RabbitMQ node (tests/harness) is started beside the shared one, behind a loopback
TCP proxy. Faults alternate between cutting every connection at the proxy and kill -9 of the
node followed by a restart. At the end every message is accounted for: confirmed ones must all
be in the queue (``lost`` must be 0), the rest must have failed explicitly. Bounded in count and
time; loopback only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pika

from harness.node import DisposableBroker
from harness.proxy import TcpProxy
from reliable_amqp import (
    Confirmation,
    EventKind,
    Publisher,
    PublisherEvent,
    RetryPolicy,
)


def drain(url: str, queue: str) -> list[bytes]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=5000)
    bodies: list[bytes] = []
    for method, _props, body in channel.consume(queue, auto_ack=True, inactivity_timeout=2.0):
        if method is None:
            break
        bodies.append(body)
    channel.cancel()
    channel.queue_delete(queue)
    connection.close()
    return bodies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to stream")
    parser.add_argument("--fault-every", type=float, default=5.0, help="seconds between faults")
    parser.add_argument("--max-messages", type=int, default=400_000, help="upper bound")
    parser.add_argument("--window", type=int, default=2000, help="max_in_flight")
    args = parser.parse_args()

    recoveries: list[float] = []
    lost_events = 0

    def on_event(event: PublisherEvent) -> None:
        nonlocal lost_events
        if event.kind is EventKind.RECOVERED and event.downtime is not None:
            recoveries.append(event.downtime)
        elif event.kind is EventKind.CONNECTION_LOST:
            lost_events += 1

    with DisposableBroker() as node, TcpProxy(node.port).start() as proxy:
        queue = "soak-" + str(int(time.time()))
        admin = pika.BlockingConnection(pika.URLParameters(node.url))
        admin.channel().queue_declare(queue, durable=True)
        admin.close()
        futures: list[Future[Confirmation]] = []
        stop = threading.Event()
        policy = RetryPolicy(max_attempts=None, initial_delay=0.1, max_delay=1.0, deadline=120)
        with Publisher(
            proxy.url(),
            max_in_flight=args.window,
            connect_policy=policy,
            delivery_timeout=180,
            heartbeat=5,
            on_event=on_event,
        ) as publisher:

            def produce() -> None:
                i = 0
                while not stop.is_set() and i < args.max_messages:
                    futures.append(publisher.publish("", queue, f"{i:08d}".encode()))
                    i += 1

            producer = threading.Thread(target=produce)
            started = time.monotonic()
            producer.start()
            faults = Counter[str]()
            next_fault = started + args.fault_every
            while time.monotonic() - started < args.seconds and producer.is_alive():
                if time.monotonic() >= next_fault:
                    if sum(faults.values()) % 2 == 0:
                        proxy.cut()
                        faults["connection cut"] += 1
                    else:
                        node.kill()
                        node.restart()
                        faults["kill -9 + restart"] += 1
                    next_fault = time.monotonic() + args.fault_every
                    print(
                        f"  t={time.monotonic() - started:5.1f}s fault #{sum(faults.values())}"
                        f" confirmed so far {publisher.stats().confirmed:,}",
                        file=sys.stderr,
                    )
                time.sleep(0.05)
            stop.set()
            producer.join()
            left = publisher.flush(timeout=180)
            streamed = time.monotonic() - started
            stats = publisher.stats()
        received = Counter(drain(node.url, queue))

    bodies = [f"{i:08d}".encode() for i in range(len(futures))]
    confirmed = [b for b, f in zip(bodies, futures, strict=True) if f.exception() is None]
    failed = [b for b, f in zip(bodies, futures, strict=True) if f.exception() is not None]
    lost = sum(1 for b in confirmed if b not in received)
    unaccounted = sum(1 for b in failed if b not in received) - 0
    duplicates = sum(n - 1 for n in received.values())
    print(f"\nsoak: {streamed:.0f} s, fault every {args.fault_every:g} s, window {args.window}")
    print(f"published            {len(futures):>10,}")
    print(f"confirmed            {len(confirmed):>10,}  ({len(confirmed) / streamed:,.0f}/s)")
    print(f"failed explicitly    {len(failed):>10,}  (of which not in queue: {unaccounted:,})")
    print(f"still pending        {left:>10,}")
    print(f"lost                 {lost:>10,}  (confirmed but not in the queue: must be 0)")
    print(f"duplicates           {duplicates:>10,}")
    print(f"republished          {stats.republished:>10,}")
    print(f"faults survived      {sum(faults.values()):>10,}  {dict(faults)}")
    if recoveries:
        print(
            f"recovery time        median {statistics.median(recoveries):.2f} s, "
            f"max {max(recoveries):.2f} s over {len(recoveries)} recoveries"
        )
    return 0 if lost == 0 and left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
