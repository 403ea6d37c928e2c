"""Sync benchmark rows: pika's three ways against reliable_amqp.Publisher, and the broker's limit.

Each row publishes ``count`` persistent messages to a fresh durable queue and reports msgs/s,
timed from the first publish to the last confirm (for "no confirms": to the last publish
returned). Connection set-up is not timed. The last row (``raw_ceiling.py``) publishes
pre-encoded frames with no client work at all: what the broker itself can confirm.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pika
from raw_ceiling import raw_confirmed_seconds

from reliable_amqp import Publisher

Row = dict[str, object]
PERSISTENT = pika.BasicProperties(delivery_mode=2)


@contextmanager
def fresh_queue(url: str) -> Iterator[tuple[pika.BlockingConnection, str]]:
    """A blocking connection and a new durable queue, deleted afterwards."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    queue = f"ra-bench-{uuid.uuid4().hex[:10]}"
    channel.queue_declare(queue, durable=True)
    try:
        yield connection, queue
    finally:
        if connection.is_open:
            channel = connection.channel()
            channel.queue_delete(queue)
            connection.close()


def _row(name: str, count: int, seconds: float, cpu: float, **extra: object) -> Row:
    """A result; ``cpu_us`` is this process's CPU time per message over the timed span."""
    return {
        "name": name,
        "msgs": count,
        "seconds": seconds,
        "rate": count / seconds,
        "cpu_us": cpu / count * 1e6,
        **extra,
    }


def pika_no_confirms(url: str, count: int, body: bytes) -> Row:
    """pika BlockingChannel, no confirm mode: fire and forget."""
    with fresh_queue(url) as (connection, queue):
        channel = connection.channel()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            channel.basic_publish("", queue, body, PERSISTENT)
        # The clock stops at a round trip after the last publish: the broker answers a
        # synchronous method on a channel only once it has routed everything sent before it.
        channel.queue_declare(queue, passive=True)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        # Not timed: wait until the queue holds them all, to start the next row from quiet.
        while channel.queue_declare(queue, passive=True).method.message_count < count:
            time.sleep(0.05)
    return _row("pika, no confirms", count, seconds, cpu)


def pika_blocking_confirms(url: str, count: int, body: bytes) -> Row:
    """pika BlockingChannel.confirm_delivery(): every publish waits for its confirm."""
    with fresh_queue(url) as (connection, queue):
        channel = connection.channel()
        channel.confirm_delivery()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            channel.basic_publish("", queue, body, PERSISTENT)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return _row("pika, BlockingChannel.confirm_delivery()", count, seconds, cpu)


def pika_transactions(url: str, count: int, body: bytes) -> Row:
    """pika with a transaction per message (tx.select once, tx.commit after each publish)."""
    with fresh_queue(url) as (connection, queue):
        channel = connection.channel()
        channel.tx_select()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            channel.basic_publish("", queue, body, PERSISTENT)
            channel.tx_commit()
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return _row("pika, transaction per message", count, seconds, cpu)


def reliable_publisher(url: str, count: int, body: bytes, mandatory: bool = True) -> Row:
    """reliable_amqp.Publisher: streaming confirms, every future checked (mandatory, the
    default; ``mandatory=False``: what the default cost before it was mandatory)."""
    with fresh_queue(url) as (_connection, queue), Publisher(url, mandatory=mandatory) as publisher:
        started, cpu = time.perf_counter(), time.process_time()
        futures = [publisher.publish("", queue, body) for _ in range(count)]
        left = publisher.flush(timeout=120)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        confirmed = sum(1 for f in futures if f.exception() is None)
    if left or confirmed != count:
        raise RuntimeError(f"Publisher confirmed {confirmed} of {count} ({left} pending)")
    name = "reliable_amqp.Publisher (streaming confirms)"
    return _row(name if mandatory else f"{name}, mandatory=False", count, seconds, cpu)


def reliable_publisher_not_mandatory(url: str, count: int, body: bytes) -> Row:
    """The Publisher row with ``mandatory=False``: the cost of mandatory, side by side."""
    return reliable_publisher(url, count, body, mandatory=False)


MANY = 1_000


def reliable_publisher_many(url: str, count: int, body: bytes) -> Row:
    """reliable_amqp.Publisher.publish_many(): 1,000 bodies a call, every future checked."""
    with fresh_queue(url) as (_connection, queue), Publisher(url) as publisher:
        started, cpu = time.perf_counter(), time.process_time()
        futures = []
        for start in range(0, count, MANY):
            futures += publisher.publish_many("", queue, [body] * min(MANY, count - start))
        left = publisher.flush(timeout=120)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        confirmed = sum(1 for f in futures if f.exception() is None)
    if left or confirmed != count:
        raise RuntimeError(f"publish_many confirmed {confirmed} of {count} ({left} pending)")
    return _row(f"reliable_amqp.Publisher.publish_many ({MANY:,} a call)", count, seconds, cpu)


def broker_ceiling(url: str, count: int, body: bytes) -> Row:
    """Frames encoded before the clock starts, written as fast as the window allows, acks read:
    the same 10,000 messages in flight as the Publisher's default, and no client work."""
    with fresh_queue(url) as (_connection, queue):
        cpu = time.process_time()
        seconds = raw_confirmed_seconds(url, queue, count, body, window=CEILING_WINDOW)
        cpu = time.process_time() - cpu  # includes encoding the frames before its clock starts
    return _row(CEILING, count, seconds, cpu)


CEILING_WINDOW = 10_000
CEILING = "raw frames, no client work (broker ceiling)"

#: name -> row function, in table order
ROWS: dict[str, Callable[[str, int, bytes], Row]] = {
    "pika-noconfirm": pika_no_confirms,
    "pika-blocking-confirm": pika_blocking_confirms,
    "pika-tx": pika_transactions,
    "publisher": reliable_publisher,
    "publisher-not-mandatory": reliable_publisher_not_mandatory,
    "publisher-many": reliable_publisher_many,
    "ceiling": broker_ceiling,
}
