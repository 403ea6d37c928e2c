"""A consumer's life at INFO: connected, subscribed, recovered, stopping, stopped.

Each line is written once per event, never per message, so a healthy idle worker and a stuck
one can be told apart from the log alone (docs/consumer.md, "Running as a service" shows the
lines as they print). Losses stay WARNING, where :mod:`reliable_amqp._consume._io` writes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from reliable_amqp._consume._options import ConsumerOptions
from reliable_amqp._consume._stats import ConsumerStats
from reliable_amqp._core.brokers import broker_limits, counts_deliveries

log = logging.getLogger("reliable_amqp")


def node_of(host: str, port: int) -> str:
    """``host:port`` (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def product_of(server_properties: Mapping[str, object] | None) -> str:
    """``RabbitMQ 3.10.7`` from a broker's ``connection.start`` properties ('' if it says none)."""
    if not server_properties:
        return ""
    words = []
    for key in ("product", "version"):
        value = server_properties.get(key)
        if isinstance(value, (bytes, bytearray)):
            value = bytes(value).decode("utf-8", "replace")
        if isinstance(value, str) and value:
            words.append(value)
    return " ".join(words)


class Lifecycle:
    """Writes one consumer's lifecycle lines (called from its I/O thread and from ``run``)."""

    def __init__(self, options: ConsumerOptions) -> None:
        self._options = options
        self._started: float | None = None
        self._announced = False

    def begin(self) -> None:
        """``run()`` starts: the next subscription is the first one again."""
        self._started = time.monotonic()
        self._announced = False

    def connected(self, node: str, product: str) -> None:
        """The first connection of a run opened (later ones are reported as recoveries)."""
        if self._announced:
            return
        log.info(
            "reliable-amqp: consumer of %r connected to %s%s",
            self._options.queue,
            node,
            f" ({product})" if product else "",
        )

    def subscribed(
        self,
        node: str,
        loss: str | None,
        attempts: int,
        seconds: float,
        server_properties: Mapping[str, object] | None = None,
    ) -> None:
        """The broker confirmed a subscription: the first of the run, or one after a loss."""
        options = self._options
        if not self._announced:
            self._announced = True
            self._check_counting(server_properties)
            own = options.own_queues
            delays = list(own[1:])
            per = ""
            if options.partitions is not None:  # the first partition's stand for every one
                delays = delays[: len(delays) // options.partitions]
                per = f" per partition of {options.partitions}"
            log.info(
                "reliable-amqp: consumer of %r subscribed (prefetch %d, concurrency %d); "
                "dead letters go to %r, retries through %d delay queue(s)%s%s",
                options.queue,
                options.prefetch,
                options.concurrency,
                own[0],
                len(delays),
                per,
                f" ({', '.join(delays)})" if delays else "",
            )
            return
        log.info(
            "reliable-amqp: consumer of %r recovered on %s after %s (%d attempt(s), %.1f s)",
            options.queue,
            node,
            loss or "a lost subscription",
            attempts,
            seconds,
        )

    def _check_counting(self, server_properties: Mapping[str, object] | None) -> None:
        """Say once, at the start, when a crash loop on this queue cannot be counted: the
        queue's type is known (the consumer declares it) and gives no delivery count, and no
        attempts ledger is configured. (A queue declared elsewhere is judged by its first
        redelivery instead: :meth:`Dispatch.fresh`.)"""
        options = self._options
        if options.attempts is not None or not (options.declare or options.queue_arguments):
            return
        limits = broker_limits(server_properties)
        if counts_deliveries(limits, options.queue_arguments):
            return
        log.warning("reliable-amqp: %s", uncounted_text(options.queue, limits.product))

    def stopping(self, running: int, waiting: int, republishing: int) -> None:
        """``run()`` is ending gracefully: what is still in hand, and what becomes of it."""
        log.info(
            "reliable-amqp: consumer of %r stopping: %d handler(s) running, %d delivery(ies) "
            "not started go back to the queue, %d retry(ies) or dead letter(s) awaiting "
            "their confirm",
            self._options.queue,
            running,
            waiting,
            republishing,
        )

    def stopped(self, stats: ConsumerStats) -> None:
        """``run()`` returned (or is about to raise): the run's totals."""
        seconds = time.monotonic() - self._started if self._started is not None else 0.0
        log.info(
            "reliable-amqp: consumer of %r stopped after %.1f s: %d consumed, %d handled, "
            "%d retried, %d dead-lettered, %d redelivered by the broker",
            self._options.queue,
            seconds,
            stats.consumed,
            stats.handled,
            stats.retried,
            stats.dead_lettered,
            stats.redelivered,
        )


def uncounted_text(queue: str, product: str, evidence: str = "") -> str:
    """Why a crash loop on ``queue`` cannot be counted, and the two ways to count it."""
    return (
        f"queue {queue!r} gives redelivered messages no delivery count{evidence} (a classic "
        f"queue, or on LavinMQ a queue without x-delivery-limit; broker: {product}), and no "
        "attempts ledger is configured: a message that kills the consumer's process each time "
        "it is handled is delivered again for ever, holding up the messages behind it. Count "
        "attempts durably with attempts=lambda d: inbox.record_attempt(connect, d) (docs/"
        "inbox.md), or use a quorum queue (on LavinMQ with x-delivery-limit, e.g. 100)"
    )
