"""A task-queue worker, done right: ack after the work, retry later, dead-letter with a reason.

Runs against the local RabbitMQ (or $AMQP_URL). It publishes 20 tasks (JSON bodies) to a queue
of its own, then works them off with a :class:`reliable_amqp.Consumer`:

- a task that succeeds is acked only after the handler returned;
- a task whose handler raises (a flaky dependency) is republished to a delay queue and tried
  again after the redelivery policy's delay: the message is never held, never requeued in a
  hot loop, and ``delivery.attempt`` says which try this is;
- a body that is not JSON can never succeed: ``Reject`` sends it to ``<queue>.dead`` at once,
  with its reason in the headers (``reliable-amqp dead-letters QUEUE`` lists them).

The worker stops when every task is accounted for (a real worker runs until SIGTERM or Ctrl-C:
``run()`` then lets the running handler finish, acks it and gives the rest back to the queue).
Last, it removes its queues, so running it again starts afresh.
"""

from __future__ import annotations

import json
import os
import uuid

import pika

from reliable_amqp import Consumer, Delivery, Publisher, Reject, RetryPolicy

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
QUEUE = os.environ.get("WORKER_QUEUE", f"reliable-amqp-worker-{uuid.uuid4().hex[:8]}")
#: fail fast in the example: 3 tries, 0.2 s then 0.4 s apart
REDELIVERY = RetryPolicy(max_attempts=3, initial_delay=0.2, multiplier=2.0, jitter=0.0)


def publish_tasks() -> int:
    with Publisher(URL) as publisher:
        publisher.declare_queue(QUEUE, durable=True)
        for n in range(18):
            task = {"task": "resize", "image": n, "flaky": n == 7}
            publisher.publish("", QUEUE, json.dumps(task).encode(), content_type="application/json")
        publisher.publish("", QUEUE, b"{not json", content_type="application/json")
        publisher.publish("", QUEUE, b'{"task": "unknown"}', content_type="application/json")
        publisher.flush(timeout=30)
    return 20


def main() -> int:
    total = publish_tasks()
    done: list[int] = []
    dead = 0
    consumer = Consumer(URL, QUEUE, prefetch=10, redelivery=REDELIVERY)

    def handle(delivery: Delivery) -> None:
        nonlocal dead
        try:
            task = json.loads(delivery.body)
        except ValueError:
            dead += 1
            raise Reject("body is not JSON") from None
        if task.get("task") != "resize":
            dead += 1
            raise Reject(f"unknown task {task.get('task')!r}")
        if task["flaky"] and delivery.attempt < 2:
            raise ConnectionError("image store timed out")  # retried after 0.2 s
        done.append(task["image"])
        print(f"resized image {task['image']} (attempt {delivery.attempt})")
        if len(done) + dead == total:
            consumer.stop()

    consumer.run(handle)
    stats = consumer.stats
    print(
        f"{len(done)} tasks done, {stats.retried} retried, {dead} dead-lettered to "
        f"{QUEUE}.dead; {stats.handled} acked"
    )
    cleanup(consumer.own_queues)
    return 0 if len(done) == 18 and dead == 2 else 1


def cleanup(own_queues: tuple[str, ...]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    dead_letters = channel.queue_declare(f"{QUEUE}.dead", passive=True).method.message_count
    print(f"{QUEUE}.dead holds {dead_letters} messages; removing the example's queues")
    for name in (QUEUE, *own_queues):  # the dead letters and the delay queues
        channel.queue_delete(name)
    connection.close()


if __name__ == "__main__":
    raise SystemExit(main())
