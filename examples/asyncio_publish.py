"""AsyncPublisher: streaming confirms from asyncio, three ways to wait, and a returned message.

Runs against the local RabbitMQ (or $AMQP_URL) on a queue of its own, deleted at the end:

1. 1,000 messages published without waiting on each, then one ``flush()``;
2. 20 tasks that each ``publish_and_wait()`` (concurrent waits share the writes);
3. a ``mandatory`` message with a routing key nothing is bound to: it fails with
   ``MessageReturned``, and nothing else is disturbed.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid

import aio_pika

from reliable_amqp import AsyncPublisher, MessageReturned, PublishError

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
COUNT = 1_000
TASKS = 20


async def main() -> int:
    queue = f"reliable-amqp-asyncio-example-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    async with AsyncPublisher(URL, connection_name="asyncio example") as publisher:
        await publisher.declare_queue(queue, durable=True)

        # 1. publish many, then flush: confirms stream back while messages go out
        futures = [
            await publisher.publish("", queue, f"hello {i}".encode(), content_type="text/plain")
            for i in range(COUNT)
        ]
        pending = await publisher.flush(timeout=30)
        failed = [f.exception() for f in futures if f.exception() is not None]
        print(f"streamed {COUNT} messages: {COUNT - len(failed)} confirmed, {pending} pending")

        # 2. many tasks, each waiting for its own confirm
        async def worker(n: int) -> int:
            confirmation = await publisher.publish_and_wait("", queue, b"task %d" % n)
            return confirmation.attempts

        attempts = await asyncio.gather(*(worker(n) for n in range(TASKS)))
        print(f"{TASKS} tasks each got their confirm (attempts: {sorted(set(attempts))})")

        # 3. an unroutable mandatory message comes back as an exception on its future
        try:
            await publisher.publish_and_wait("", f"{queue}-nobody", b"lost", mandatory=True)
        except MessageReturned as exc:
            print(f"returned as expected: {exc.reply_code} {exc.reply_text}")

    # The publisher's connection is closed; delete the queue with a short-lived one.
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        count = declared.declaration_result.message_count
        await declared.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
    elapsed = time.perf_counter() - started
    print(f"queue {queue!r} held {count} messages, now deleted ({elapsed:.2f} s in all)")
    return 0 if not failed and count == COUNT + TASKS else 1


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except PublishError as exc:
        print(f"failed: {exc}", file=sys.stderr)
        sys.exit(1)
