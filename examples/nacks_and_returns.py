"""Handling the messages a broker does not take: nacks, returns and rejections.

Three situations, each with what the failure carries and one sensible reaction:

1. A full queue (``x-max-length`` with ``x-overflow=reject-publish``) nacks what does not fit.
   After the nack retry policy is spent the future fails with ``MessageNacked``; the exception
   carries the message, so it can be kept and published again once there is room.
2. A message no queue is bound for comes back: ``MessageReturned`` (312 NO_ROUTE), since
   messages are mandatory by default. With ``mandatory=False`` the broker confirms it and drops it.
3. A message to an exchange that does not exist makes the broker close the channel (404):
   ``MessageRejected`` fails that message alone; the others go on, on a new channel. (One sent
   just before it whose confirm was lost with the channel is sent again: it may reach its queue
   twice, both copies with the same ``message_id``. That is at-least-once delivery.)
"""

from __future__ import annotations

import os
import sys
import uuid
from concurrent.futures import Future

import pika

from reliable_amqp import (
    Confirmation,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    OutgoingMessage,
    Publisher,
    PublishError,
)

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def outcome(future: Future[Confirmation]) -> str:
    try:
        confirmation = future.result(timeout=30)
    except MessageNacked as exc:
        return f"nacked after {exc.attempts} attempts"
    except MessageReturned as exc:
        return f"returned: {exc.reply_code} {exc.reply_text}"
    except MessageRejected as exc:
        return f"rejected: {exc.reply_code} {exc.reply_text}"
    except PublishError as exc:
        return f"failed: {exc}"
    return f"confirmed (message_id {confirmation.message_id})"


def main() -> int:
    suffix = uuid.uuid4().hex[:8]
    small = f"example-small-{suffix}"
    roomy = f"example-roomy-{suffix}"
    exchange = f"example-unbound-{suffix}"
    ok = True
    # A short nack policy so the example is quick: 2 attempts, 50 ms apart.
    with Publisher(URL, nack_policy={"max_attempts": 2, "initial_delay": 0.05}) as publisher:
        try:
            print("1. a queue with room for 3 messages, and 5 messages")
            publisher.declare_queue(
                small, arguments={"x-max-length": 3, "x-overflow": "reject-publish"}
            )
            futures = [publisher.publish("", small, b"order %d" % i) for i in range(5)]
            publisher.flush(timeout=30)
            kept: list[OutgoingMessage] = []
            for i, future in enumerate(futures):
                print(f"   order {i}: {outcome(future)}")
                error = future.exception()
                if isinstance(error, MessageNacked):
                    kept.append(error.message)  # the whole message: body, properties, id
            ok &= len(kept) == 2
            print(f"   kept {len(kept)} nacked messages; making room and publishing them again")
            purge(small)
            again = [
                publisher.publish(
                    m.exchange,
                    m.routing_key,
                    m.body,
                    message_id=m.message_id,  # same id
                    headers=dict(m.properties.headers or {}),
                )
                for m in kept
            ]
            for future in again:
                print(f"   again: {outcome(future)}")
                ok &= future.exception() is None

            print("2. mandatory messages to an exchange bound to no queue")
            publisher.declare_exchange(exchange, "direct")
            returned = publisher.publish(exchange, "nowhere", b"lost?")  # mandatory by default
            dropped = publisher.publish(exchange, "nowhere", b"lost!", mandatory=False)
            print(f"   mandatory:     {outcome(returned)}")
            print(f"   not mandatory: {outcome(dropped)}  <- confirmed, but no queue has it")
            ok &= isinstance(returned.exception(), MessageReturned)

            print("3. an exchange that does not exist, between two good messages")
            publisher.declare_queue(roomy)
            before = publisher.publish("", roomy, b"before")
            missing = publisher.publish(f"example-missing-{suffix}", "key", b"to nowhere")
            after = publisher.publish("", roomy, b"after")
            for name, future in (("before", before), ("missing", missing), ("after", after)):
                print(f"   {name}: {outcome(future)}")
            ok &= isinstance(missing.exception(), MessageRejected)
            ok &= before.exception() is None and after.exception() is None
        finally:
            cleanup(queues=[small, roomy], exchange=exchange)
    print("all outcomes as expected" if ok else "UNEXPECTED outcomes")
    return 0 if ok else 1


# The library publishes; it does not consume or delete. These two use pika directly.


def purge(queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        connection.channel().queue_purge(queue)
    finally:
        connection.close()


def cleanup(queues: list[str], exchange: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    try:
        channel = connection.channel()
        for queue in queues:
            channel.queue_delete(queue)
        channel.exchange_delete(exchange)
    finally:
        connection.close()


if __name__ == "__main__":
    sys.exit(main())
