"""What both consumers do around a handler call: admit a delivery, then act on the outcome.

The decisions are the core's (:mod:`reliable_amqp._core.redelivery`); the sync and the async
consumer differ only in how they call the handler, so everything before and after it is here,
once.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from reliable_amqp._consume._lifecycle import uncounted_text
from reliable_amqp._consume._link import ConsumerLink
from reliable_amqp._consume._options import ConsumerOptions
from reliable_amqp._consume._redeliver import Redeliverer
from reliable_amqp._consume._stats import ConsumerStats
from reliable_amqp._core.acks import ACK
from reliable_amqp._core.brokers import broker_limits
from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.order import AfterDeadLetter, Fences, key_reader, parked_seq
from reliable_amqp._core.redelivery import Retry, before_handler, on_failure

if TYPE_CHECKING:
    from reliable_amqp._otel._consume import ConsumerTelemetry

log = logging.getLogger("reliable_amqp")


class Reject(ReliableAmqpError):
    """Raise it from a handler to dead-letter the message at once, with ``reason``.

    For a message that can never succeed (a body that does not parse, a reference to something
    that does not exist): retrying it would only delay the dead letter.
    """

    permanent = True

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Dispatch:
    """The handler side's bookkeeping, shared by :class:`Consumer` and :class:`AsyncConsumer`."""

    __slots__ = (
        "_counting_known",
        "_io",
        "_max_attempts",
        "_options",
        "_redeliver",
        "_settle",
        "_unparked",
        "fences",
        "key_of",
        "stats",
        "telemetry",
    )

    def __init__(
        self,
        options: ConsumerOptions,
        io: ConsumerLink,
        redeliver: Redeliverer,
        stats: ConsumerStats,
    ) -> None:
        self._options = options
        self._io = io
        self._settle = io.settle  # (bound once: called for every delivery)
        self._redeliver = redeliver
        self._max_attempts = options.max_attempts
        self.stats = stats
        # True once it is known that crash loops are counted (a ledger), or once said not; for
        # a queue the consumer declares, the lifecycle's check at start says it
        self._counting_known = (
            options.attempts is not None or options.declare or options.queue_arguments is not None
        )
        #: the delivery's key (None: the consumer keeps no per-key order)
        self.key_of = key_reader(options.key)
        after: AfterDeadLetter = "hold" if options.after_dead_letter == "hold" else "continue"
        self.fences = Fences(after)
        # keys whose park failed, told from the publisher's thread; applied on this side
        self._unparked: deque[tuple[str, int]] = deque()
        #: spans and metrics (None: OpenTelemetry is not in use), set when consuming starts
        self.telemetry: ConsumerTelemetry | None = None

    def fresh(self, delivery: Delivery) -> bool:
        """False for a delivery of a channel that died (the broker gives it back): skip it."""
        stats = self.stats
        if not self._io.is_live(delivery.generation):
            stats.stale += 1
            return False
        stats.consumed += 1
        if delivery.redelivered:
            stats.redelivered += 1
            if self.telemetry is not None:
                self.telemetry.count("redelivered")
            if not self._counting_known:
                self._check_count(delivery)
        return True

    def _check_count(self, delivery: Delivery) -> None:
        """A redelivery is the evidence of whether the queue counts deliveries: said once."""
        headers = delivery.headers
        if headers and "x-delivery-count" in headers:
            self._counting_known = True
            return
        self._counting_known = True
        product = broker_limits(self._io.server_properties).product
        evidence = f" (message {delivery.message_id!r} came back without x-delivery-count)"
        log.warning("reliable-amqp: %s", uncounted_text(self._options.queue, product, evidence))

    def dead_before(self, delivery: Delivery) -> bool:
        """True (and the delivery dead-lettered) when it is dead before its handler starts:
        undecodable headers, or past ``max_attempts`` already (a crash loop)."""
        if delivery.header_error is None and delivery.attempt <= self._max_attempts:
            return False
        dead = before_handler(delivery.attempt, delivery.header_error, self._max_attempts)
        if dead is None:
            return False
        self._redeliver.dead(delivery, dead)
        return True

    def count_attempt(self, delivery: Delivery, counted: object) -> None:
        """Take a durable attempt count (the ``attempts`` option's answer) into ``delivery``."""
        if type(counted) is not int:
            raise TypeError(
                f"the attempts counter returned {counted!r}, not an int (the attempt number)"
            )
        delivery.attempt = max(delivery.attempt, counted)

    def park(self, delivery: Delivery, key: str) -> bool:
        """True (and the delivery on its way to its key's follow queue) when ``key`` is fenced
        and this delivery must wait behind the key's head (:mod:`reliable_amqp._core.order`)."""
        fences = self.fences
        unparked = self._unparked
        while unparked:
            fences.unpark(*unparked.popleft())
        if not len(fences):
            return False
        headers = delivery.headers
        admitted = fences.admit(key, headers, delivery.message_id)
        if admitted is None:
            return False
        queue, seq = admitted
        self.stats.parked += 1
        first = parked_seq(headers) is None  # a first park that fails leaves a gap to skip
        self._redeliver.park(delivery, queue, key, seq, unparked.append if first else None)
        return True

    def succeeded(self, delivery: Delivery, key: str | None = None) -> None:
        """The handler returned: the delivery is acked (in the next batch)."""
        if key is not None and len(self.fences):
            self.fences.settled(key, parked_seq(delivery.headers))
        self.stats.handled += 1
        self._settle(delivery.generation, delivery.delivery_tag, ACK)
        if self.telemetry is not None:
            self.telemetry.count("handled")

    def failed(self, delivery: Delivery, error: BaseException, key: str | None = None) -> None:
        """The handler raised ``error``: retry later or dead-letter (the ack follows the
        confirmed republish). :class:`Reject` and the library's errors that depend on the
        message alone (``permanent``: MissingMessageId, InvalidMessage, HeaderDecodeError)
        are dead-lettered at once."""
        verdict = on_failure(
            delivery.queue,
            delivery.attempt,
            error,
            self._options.redelivery,
            rejected=getattr(type(error), "permanent", False) is True,
        )
        seq = parked_seq(delivery.headers) if key is not None else None
        if isinstance(verdict, Retry):
            token = None
            if key is not None:  # the key's head now: its later messages wait for it
                token = self.fences.retrying(key, self._options.follow_queue(delivery.queue), seq)
            self._redeliver.retry(delivery, verdict, token)
        else:
            if key is not None:
                follow = self._options.follow_queue(delivery.queue)
                self.fences.dead(key, follow, seq, delivery.message_id or "")
            self._redeliver.dead(delivery, verdict)
