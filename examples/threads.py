"""Many threads sharing one Publisher.

A Publisher is thread-safe: any thread may call ``publish()``; one I/O thread owns the
connection and settles confirms for all of them. Here 8 worker threads each publish 1,000
messages to one queue, collect their own futures, and count what was confirmed. The main thread
then checks the queue holds every confirmed message, and deletes the queue.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from concurrent.futures import Future

import pika

from reliable_amqp import Confirmation, Publisher, PublishError

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
THREADS = 8
PER_THREAD = 1_000


# --8<-- [start:worker]
def worker(publisher: Publisher, queue: str, number: int, results: dict[int, int]) -> None:
    futures: list[Future[Confirmation]] = []
    for i in range(PER_THREAD):
        # publish() returns at once; it blocks only while the in-flight window is full.
        futures.append(
            publisher.publish(
                "", queue, f"thread {number} message {i}".encode(), headers={"thread": number}
            )
        )
    confirmed = 0
    for future in futures:
        try:
            future.result(timeout=60)  # each future resolves exactly once
            confirmed += 1
        except PublishError as exc:
            print(f"thread {number}: {exc}", file=sys.stderr)
    results[number] = confirmed


# --8<-- [end:worker]


def main() -> int:
    queue = f"example-threads-{uuid.uuid4().hex[:8]}"
    results: dict[int, int] = {}
    try:
        # --8<-- [start:threads]
        with Publisher(URL, connection_name="examples/threads.py") as publisher:
            publisher.declare_queue(queue, durable=True)
            threads = [
                threading.Thread(target=worker, args=(publisher, queue, n, results))
                for n in range(THREADS)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        # --8<-- [end:threads]
        in_queue = queue_length(queue)
    finally:
        delete_queue(queue)
    confirmed = sum(results.values())
    for number in sorted(results):
        print(f"thread {number}: {results[number]} of {PER_THREAD} confirmed")
    print(f"{confirmed} of {THREADS * PER_THREAD} confirmed; the queue held {in_queue}")
    return 0 if confirmed == THREADS * PER_THREAD == in_queue else 1


# The library publishes; it does not consume or delete. These two use pika directly.


def queue_length(queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def delete_queue(queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        connection.channel().queue_delete(queue)
    finally:
        connection.close()


if __name__ == "__main__":
    sys.exit(main())
