"""Quickstart: publish messages with streaming confirms and print what became of each.

Runs against the local RabbitMQ (or $AMQP_URL): declares a durable queue, publishes 1,000
persistent messages without waiting on each, then waits for every confirm at once.
"""

from __future__ import annotations

import os
import sys
import time

from reliable_amqp import Publisher, PublishError

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = os.environ.get("QUICKSTART_QUEUE", "reliable-amqp-quickstart")
COUNT = int(os.environ.get("QUICKSTART_COUNT", "1000"))


def main() -> int:
    started = time.perf_counter()
    with Publisher(URL) as publisher:
        publisher.declare_queue(QUEUE, durable=True)
        futures = [
            publisher.publish("", QUEUE, f"hello {i}".encode(), content_type="text/plain")
            for i in range(COUNT)
        ]
        publisher.flush(timeout=30)
    confirmed = failed = 0
    for future in futures:
        try:
            future.result()
            confirmed += 1
        except PublishError as exc:
            failed += 1
            print(f"failed: {exc}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    print(
        f"published {COUNT} persistent messages to queue {QUEUE!r}: "
        f"{confirmed} confirmed by the broker, {failed} failed ({elapsed:.2f} s)"
    )
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
