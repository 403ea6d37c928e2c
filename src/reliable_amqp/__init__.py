"""reliable_amqp: lossless, fast publishing to AMQP 0-9-1 brokers (RabbitMQ, LavinMQ).

Every message handed to a publisher resolves exactly once: confirmed by the broker, or failed with
a :class:`PublishError` subclass that says why. See ``docs/`` for the delivery contract.
"""

from typing import TYPE_CHECKING

from reliable_amqp._core.errors import (
    AccessRefused,
    AmqpConnectionError,
    AuthenticationFailed,
    BrokerError,
    ConfigurationError,
    ConnectionForced,
    DeliveryTimeout,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    NotAllowed,
    NotFound,
    OperationTimeout,
    PreconditionFailed,
    PublisherClosed,
    PublisherForked,
    PublishError,
    PublishTimeout,
    RecoveryFailed,
    ReliableAmqpError,
    SpoolError,
    SpoolFull,
    SpoolWriteError,
    TlsError,
    WouldDeadlock,
    broker_error,
)
from reliable_amqp._core.message import Confirmation, MessageProperties, OutgoingMessage
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import EventKind, LatencySummary, PublisherEvent, Stats
from reliable_amqp._sync.publisher import Publisher

if TYPE_CHECKING:
    from reliable_amqp._async.publisher import AsyncPublisher as AsyncPublisher

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # AsyncPublisher needs the `aio` extra: aio-pika is imported only when it is asked for.
    if name == "AsyncPublisher":
        from reliable_amqp._async import AsyncPublisher

        return AsyncPublisher
    raise AttributeError(f"module 'reliable_amqp' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the public names (AsyncPublisher among them, though loaded on first use), not the
    # helpers of this module (TYPE_CHECKING) nor the private submodules
    return sorted({*__all__, "AsyncPublisher"})


__all__ = [
    "AccessRefused",
    "AmqpConnectionError",
    "AuthenticationFailed",
    "BrokerError",
    "ConfigurationError",
    "Confirmation",
    "ConnectionForced",
    "DeliveryTimeout",
    "EventKind",
    "InvalidMessage",
    "LatencySummary",
    "MessageNacked",
    "MessageProperties",
    "MessageRejected",
    "MessageReturned",
    "NotAllowed",
    "NotFound",
    "OperationTimeout",
    "OutgoingMessage",
    "PreconditionFailed",
    "PublishError",
    "PublishTimeout",
    "Publisher",
    "PublisherClosed",
    "PublisherForked",
    "PublisherEvent",
    "PublisherOptions",
    "RecoveryFailed",
    "ReliableAmqpError",
    "RetryPolicy",
    "SpoolError",
    "SpoolFull",
    "SpoolWriteError",
    "State",
    "Stats",
    "TlsError",
    "WouldDeadlock",
    "__version__",
    "broker_error",
    "redact_url",
]
