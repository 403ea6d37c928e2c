"""What each broker takes, where brokers differ: a small table keyed by the product name a
broker gives in ``connection.start`` (its ``server_properties``).

A limit that every broker shares is checked where a message is built (``_core.builder``),
whatever the broker. A limit here applies only once the connected broker is known: a publisher
checks ``publish()`` against the broker of its current (or last) connection, and a message it
took before that broker was known is refused when it is written, alone, as it would be refused
by the broker (see :meth:`BrokerLimits.check_expiration`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from reliable_amqp._core.errors import InvalidMessage

#: RabbitMQ refuses a per-message TTL over ten years (406 "invalid expiration", value_too_large)
RABBITMQ_EXPIRATION_MAX = 315_360_000_000
#: LavinMQ parses ``expiration`` as a signed 32-bit integer: anything larger closes the
#: channel with 406 "Expiration not a number" (LavinMQ 2.9, ``valid_expiration?``)
LAVINMQ_EXPIRATION_MAX = 2**31 - 1


class BrokerLimitExceeded(InvalidMessage):
    """A message the connected broker cannot take, although another broker would (an
    :class:`InvalidMessage`: nothing was sent)."""


@dataclass(frozen=True, slots=True)
class BrokerLimits:
    """The limits of one broker product that are tighter than what every broker takes."""

    #: the product name, as the broker gives it
    product: str
    #: the largest per-message TTL (``expiration``, milliseconds) the broker takes
    expiration_max: int
    #: what the broker answers beyond it (for the error's text)
    expiration_reply: str
    #: the offset a stream's first message gets: RabbitMQ's streams count from 0, LavinMQ's
    #: from 1 (its first segment starts at offset 1); offsets below it never exist
    first_stream_offset: int = 0
    #: whether a quorum queue counts deliveries (``x-delivery-count``) without a
    #: ``x-delivery-limit``: RabbitMQ's do; LavinMQ 2.9 declares a classic queue for
    #: ``x-queue-type=quorum`` and counts only when a limit is set
    counts_without_limit: bool = True
    #: whether a passive ``queue.declare`` of a stream answers with the number of messages it
    #: holds, each at the next offset, so that its end is its first offset plus that count:
    #: LavinMQ's does, at once (its stream store counts the messages it holds); RabbitMQ's count
    #: of a stream lags (3.10: 0 until a stats tick, about 4 s after 1,000 publishes) and its
    #: offsets include entries of the stream's own
    stream_count_is_span: bool = False
    #: whether a new stream consumer's first deliveries come before the broker's answer to the
    #: channel's next method, so that a ``basic.qos`` is a barrier after what the stream's
    #: reader had at hand: RabbitMQ's channel process reads the stream first (usually: not
    #: while the stream is written and trimmed); LavinMQ runs consumers apart from the channel
    stream_qos_barrier: bool = False

    @property
    def checks_expiration(self) -> bool:
        """Whether ``expiration`` needs a check beyond the one every message gets."""
        return self.expiration_max < RABBITMQ_EXPIRATION_MAX

    def check_expiration(self, expiration: str) -> None:
        """Raise :class:`BrokerLimitExceeded` when this broker refuses ``expiration`` (a
        checked one: ASCII digits only).

        Called only for messages that set ``expiration``, and cheap there: a value with fewer
        digits than the limit is compared by its length alone.
        """
        if len(expiration) < _DIGITS.get(self.expiration_max, 0):
            return
        if int(expiration) > self.expiration_max:
            raise BrokerLimitExceeded(
                "expiration",
                f"{expiration} ms is over {self.product}'s limit of {self.expiration_max} ms "
                f"(the broker would close the channel: {self.expiration_reply})",
            )


#: what every broker takes (RabbitMQ's limits); a broker that is not in the table gets these
ANY_BROKER = BrokerLimits("AMQP 0-9-1 broker", RABBITMQ_EXPIRATION_MAX, "")
RABBITMQ = BrokerLimits(
    "RabbitMQ", RABBITMQ_EXPIRATION_MAX, '406 "invalid expiration"', stream_qos_barrier=True
)
LAVINMQ = BrokerLimits(
    "LavinMQ",
    LAVINMQ_EXPIRATION_MAX,
    '406 "Expiration not a number"',
    first_stream_offset=1,
    counts_without_limit=False,
    stream_count_is_span=True,
)

#: by product name, lower-cased
BROKERS: Mapping[str, BrokerLimits] = {"rabbitmq": RABBITMQ, "lavinmq": LAVINMQ}

# how many digits each limit has: an expiration with fewer is below it, no int() needed
_DIGITS = {limits.expiration_max: len(str(limits.expiration_max)) for limits in BROKERS.values()}


def broker_limits(server_properties: Mapping[str, object] | None) -> BrokerLimits:
    """The limits of the broker whose ``connection.start`` gave ``server_properties`` (None:
    not known); :data:`ANY_BROKER` for a product not in :data:`BROKERS`."""
    if not server_properties:
        return ANY_BROKER
    product = server_properties.get("product")
    if isinstance(product, (bytes, bytearray)):  # a longstr a client library left undecoded
        product = bytes(product).decode("utf-8", "replace")
    if not isinstance(product, str):
        return ANY_BROKER
    return BROKERS.get(product.strip().lower(), ANY_BROKER)


def counts_deliveries(limits: BrokerLimits, arguments: Mapping[str, object] | None) -> bool:
    """Whether a queue declared with ``arguments`` on this broker gives redelivered messages a
    delivery count (``x-delivery-count``), which is how a consumer sees a crash loop (a message
    that kills the process each time it is handled) without a ledger of its own."""
    args = arguments or {}
    kind = args.get("x-queue-type")
    if isinstance(kind, bytes):
        kind = kind.decode("utf-8", "replace")
    if kind != "quorum":
        return False  # classic queues give only the redelivered flag; streams never redeliver
    return limits.counts_without_limit or "x-delivery-limit" in args
