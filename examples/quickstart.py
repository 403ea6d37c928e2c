"""Quickstart: publish messages with streaming confirms and print what became of each.

Runs against the local RabbitMQ (or $AMQP_URL): declares a durable queue, publishes 1,000
persistent messages without waiting on each, then waits for every confirm at once. Last, it
reads its messages back from the queue, as a consumer would, so that the queue is left as it was
found (running it again does not pile messages up).
"""

from __future__ import annotations

import os
import sys
import time

import pika

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
    confirmed: set[str] = set()
    failed = 0
    for future in futures:
        try:
            confirmed.add(future.result().message_id)
        except PublishError as exc:
            failed += 1
            print(f"failed: {exc}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    print(
        f"published {COUNT} persistent messages to queue {QUEUE!r}: "
        f"{len(confirmed)} confirmed by the broker, {failed} failed ({elapsed:.2f} s)"
    )
    found = take_back(confirmed)
    print(f"read back {found} of them from the queue (it is left as it was found)")
    return 0 if failed == 0 and found == len(confirmed) else 1


def take_back(message_ids: set[str]) -> int:
    """Consume this run's messages from the queue (a confirmed message is in it) and leave any
    other message there, in its place; how many were found."""
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    others: list[int] = []
    found = 0
    while found < len(message_ids):
        method, properties, _body = channel.basic_get(QUEUE)
        if method is None:  # the queue holds no more
            break
        if properties.message_id in message_ids:
            channel.basic_ack(method.delivery_tag)
            found += 1
        else:  # not this run's: put back after the loop (requeued to its place)
            others.append(method.delivery_tag)
    for tag in others:
        channel.basic_nack(tag, requeue=True)
    connection.close()
    return found


if __name__ == "__main__":
    sys.exit(main())
