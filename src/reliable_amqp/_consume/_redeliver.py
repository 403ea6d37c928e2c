"""Retries and dead letters, carried out: a confirmed publish first, the ack of the original after.

The decisions are :mod:`reliable_amqp._core.redelivery`'s; this module publishes what they say
through the library's own :class:`~reliable_amqp.Publisher` (confirms, mandatory: "confirmed"
means "stored in a queue") on a connection of its own, then settles the original delivery on the
consumer's channel. A republish that fails (nacked after the publisher's own retries, returned)
gives the original back to the queue instead: it is delivered again later, never lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import pika

from reliable_amqp._consume._link import ConsumerLink
from reliable_amqp._consume._options import ConsumerOptions
from reliable_amqp._consume._stats import ConsumerStats
from reliable_amqp._core.acks import ACK, REQUEUE
from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.errors import AccessRefused, ReliableAmqpError
from reliable_amqp._core.order import HEAD_HEADER, PARKED_HEADER
from reliable_amqp._core.redelivery import (
    MAX_DELAY_MS,
    NO_ID_HEADER,
    DeadLetter,
    Retry,
    dead_letter_headers,
    delay_levels,
    delay_queue,
    retry_headers,
)
from reliable_amqp._sync._pika import refusal_at
from reliable_amqp._sync.publisher import Publisher

if TYPE_CHECKING:
    from reliable_amqp._otel._consume import ConsumerTelemetry

log = logging.getLogger("reliable_amqp")

#: properties a republished copy keeps (headers are rebuilt; expiration is not carried: a
#: copy waiting in a delay queue must not expire there, and a dead letter must stay)
_KEPT = (
    "content_type",
    "content_encoding",
    "priority",
    "correlation_id",
    "reply_to",
    "timestamp",
    "type",
    "app_id",
)


class Redeliverer:
    """Publishes retries and dead letters for one consumer, and settles the originals."""

    def __init__(self, options: ConsumerOptions, io: ConsumerLink, stats: ConsumerStats) -> None:
        self._options = options
        self._io = io
        self._stats = stats
        self._publisher: Publisher | None = None
        self._lock = threading.Lock()
        #: spans and metrics (None: OpenTelemetry is not in use), set when consuming starts
        self.telemetry: ConsumerTelemetry | None = None

    def open(self) -> None:
        """Connect the publisher and declare the dead-letter and delay queues (idempotent)."""
        with self._lock:
            if self._publisher is not None:
                return
            options = self._options
            publisher = Publisher(list(options.connection.urls), **_publisher_kwargs(options))
            publisher.connect()
            declaring = options.dead_letter_queue
            try:
                publisher.declare_queue(declaring, durable=True)
                for queue in options.consumed_queues:  # options.own_queues, with their TTLs
                    for level in delay_levels(options.redelivery):
                        declaring = delay_queue(queue, level)
                        publisher.declare_queue(
                            declaring,
                            durable=True,
                            arguments={
                                "x-message-ttl": min(level, MAX_DELAY_MS),
                                "x-dead-letter-exchange": "",
                                "x-dead-letter-routing-key": queue,
                            },
                        )
            except AccessRefused as exc:
                publisher.close(timeout=1.0)
                raise _refused(exc, declaring, options) from exc
            except BaseException:
                publisher.close(timeout=1.0)
                raise
            self._publisher = publisher

    def close(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for what is being republished, then close; returns how many
        were left unconfirmed (their originals stay unacked: the broker redelivers them)."""
        with self._lock:
            publisher, self._publisher = self._publisher, None
        if publisher is None:
            return 0
        return publisher.close(timeout=timeout)

    @property
    def pending(self) -> int:
        """Retries and dead letters published and not yet confirmed."""
        publisher = self._publisher
        return 0 if publisher is None else publisher.in_flight

    def flush(self, timeout: float) -> int:
        """Wait for every republish so far to be confirmed; returns how many are pending."""
        publisher = self._publisher
        return 0 if publisher is None else publisher.flush(timeout)

    def retry(self, delivery: Delivery, retry: Retry, token: str | None = None) -> None:
        """Republish ``delivery`` to its delay queue; ack the original once confirmed.
        ``token``: it is its key's head (:mod:`reliable_amqp._core.order`)."""
        self._stats.retried += 1
        if self.telemetry is not None:
            self.telemetry.count("retried")
        headers = retry_headers(
            delivery.headers, retry, delivery.queue, delivery.exchange, delivery.routing_key
        )
        headers.pop(PARKED_HEADER, None)
        headers.pop(HEAD_HEADER, None)
        if token is not None:
            headers[HEAD_HEADER] = token
        future = self._publish(delivery, retry.queue, headers)
        future.add_done_callback(lambda f: self._settled(delivery, f, None))

    def park(
        self,
        delivery: Delivery,
        queue: str,
        key: str,
        seq: int,
        unparked: Callable[[tuple[str, int]], None] | None,
    ) -> None:
        """Republish ``delivery`` to its fenced key's follow queue as park number ``seq``,
        behind the key's other waiting messages, its attempt unchanged; ack the original once
        confirmed. A park that fails calls ``unparked((key, seq))`` and gives the original
        back to the queue."""
        headers = retry_headers(
            delivery.headers,
            Retry(queue, 0, delivery.attempt),
            delivery.queue,
            delivery.exchange,
            delivery.routing_key,
        )
        headers.pop(HEAD_HEADER, None)
        headers[PARKED_HEADER] = seq
        future = self._publish(delivery, queue, headers)

        def done(f: Future[Any]) -> None:
            if unparked is not None and (f.cancelled() or f.exception() is not None):
                unparked((key, seq))
            self._settled(delivery, f, None, "park")

        future.add_done_callback(done)

    def dead(self, delivery: Delivery, dead: DeadLetter) -> None:
        """Publish ``delivery`` to the dead-letter queue; ack the original once confirmed."""
        headers = dead_letter_headers(
            delivery.headers, dead, delivery.queue, delivery.exchange, delivery.routing_key
        )
        headers.pop(PARKED_HEADER, None)
        headers.pop(HEAD_HEADER, None)
        future = self._publish(delivery, self._options.dead_letter_queue, headers)
        future.add_done_callback(lambda f: self._settled(delivery, f, dead))

    def _publish(self, delivery: Delivery, queue: str, headers: dict[str, Any]) -> Future[Any]:
        publisher = self._publisher
        if publisher is None:
            raise RuntimeError("the consumer's publisher is not open")
        props = delivery.properties
        kept = {name: getattr(props, name) for name in _KEPT if getattr(props, name) is not None}
        if delivery.message_id:
            kept["message_id"] = delivery.message_id
        else:  # the publisher gives every message an id: mark this one's as not the message's
            headers[NO_ID_HEADER] = True
        return publisher.publish("", queue, delivery.body, mandatory=True, headers=headers, **kept)

    def _settled(
        self,
        delivery: Delivery,
        future: Future[Any],
        dead: DeadLetter | None,
        what: str = "schedule a retry of",
    ) -> None:
        # On the publisher's I/O thread: only bookkeeping here, never a wait.
        error = future.exception() if not future.cancelled() else None
        if error is None and not future.cancelled():
            if dead is not None:
                self._stats.dead_lettered += 1
                if self.telemetry is not None:
                    self.telemetry.count("dead_lettered")
                log.warning(
                    "reliable-amqp: message %r from queue %r dead-lettered to %r after %d "
                    "attempt(s): %s (%s)",
                    delivery.message_id,
                    delivery.queue,
                    self._options.dead_letter_queue,
                    dead.attempts,
                    dead.reason,
                    dead.exception_type,
                )
            self._io.settle(delivery.generation, delivery.delivery_tag, ACK, urgent=True)
            return
        # Not stored: the original goes back to the queue and comes again (a later attempt
        # republishes it again). Said once, at WARNING: the user may have a full queue.
        self._stats.republish_failed += 1
        log.warning(
            "reliable-amqp: could not %s message %r of queue %r (%s); it goes back to the queue",
            "dead-letter" if dead is not None else what,
            delivery.message_id,
            delivery.queue,
            error,
        )
        self._io.settle(delivery.generation, delivery.delivery_tag, REQUEUE, urgent=True)


def _refused(exc: AccessRefused, queue: str, options: ConsumerOptions) -> ReliableAmqpError:
    """A 403 on one of the consumer's own queues, naming the permission to grant."""
    params = pika.URLParameters(options.connection.urls[0])
    own = ", ".join(repr(name) for name in options.own_queues)
    better = refusal_at(
        params,
        403,
        exc.text,
        operation="queue.declare",
        name=queue,
        why=(
            f"the consumer declares its own queues ({own}) at start, and publishes retries "
            "and dead letters to them, which needs 'write' on the default exchange too"
        ),
    )
    return better if better is not None else exc


def _publisher_kwargs(options: ConsumerOptions) -> dict[str, Any]:
    kwargs = dict(options.connection.kwargs())
    kwargs.pop("urls", None)
    kwargs.pop("spool", None)  # republishes are tied to deliveries: never spooled
    name = kwargs.get("connection_name")
    kwargs["connection_name"] = f"{name or 'reliable-amqp consumer'} (redelivery)"
    return kwargs
