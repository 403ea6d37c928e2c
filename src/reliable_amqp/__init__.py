"""reliable_amqp: lossless, fast publishing to AMQP 0-9-1 brokers (RabbitMQ, LavinMQ).

Every message handed to a publisher resolves exactly once: confirmed by the broker, or failed with
a :class:`PublishError` subclass that says why. See ``docs/`` for the delivery contract.

``__all__`` below is the whole public surface: the publishers, what goes into them, what they
report, and every exception they raise (``reliable_amqp.spark`` exports the Spark extra's own).
The modules behind it are private.
"""

import typing as _typing

from reliable_amqp._compat import IncompatibleDependency
from reliable_amqp._consume import (
    AsyncConsumer,
    Consumer,
    ConsumerHealth,
    ConsumerStats,
    HandlerCancelled,
    HandlerTimeout,
    Reject,
)
from reliable_amqp._core.brokers import BrokerLimitExceeded
from reliable_amqp._core.callables import WrongHandlerKind
from reliable_amqp._core.delivery import Delivery, HeaderDecodeError
from reliable_amqp._core.errors import (
    AccessRefused,
    AmqpConnectionError,
    AmqpNotImplemented,
    AmqpSyntaxError,
    AuthenticationFailed,
    BrokerError,
    ChannelError,
    CommandInvalid,
    ConfigurationError,
    ConnectionForced,
    ContentTooLarge,
    DeliveryTimeout,
    FrameError,
    InternalError,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    MissingMessageId,
    NoConsumers,
    NoRoute,
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
    ResourceError,
    ResourceLocked,
    SpoolError,
    SpoolFull,
    SpoolWriteError,
    TlsError,
    UnexpectedFrame,
    WouldDeadlock,
)
from reliable_amqp._core.message import Confirmation, MessageProperties, OutgoingMessage
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.refusals import QueueNotFound
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import EventKind, LatencySummary, PublisherEvent, Stats
from reliable_amqp._sync.publisher import Publisher
from reliable_amqp._version import __version__

if _typing.TYPE_CHECKING:
    from reliable_amqp._async.publisher import AsyncPublisher as AsyncPublisher


# fmt: off
__all__ = [
    "__version__",
    # publishers (AsyncPublisher needs the `aio` extra: it is imported on first use)
    "Publisher", "AsyncPublisher",
    # consumers (AsyncConsumer needs no extra: asyncio only)
    "Consumer", "AsyncConsumer", "Delivery", "Reject", "ConsumerStats", "ConsumerHealth",
    # ... what a consumer reports about a delivery (each is dead-lettered or retried, never lost)
    "HeaderDecodeError", "HandlerTimeout", "HandlerCancelled",
    # ... what a consumer refuses: a handler of the wrong kind, a queue it cannot consume
    "WrongHandlerKind", "QueueNotFound",
    # messages and options
    "OutgoingMessage", "MessageProperties", "Confirmation", "PublisherOptions", "RetryPolicy",
    # state, events and stats
    "State", "EventKind", "PublisherEvent", "Stats", "LatencySummary",
    # errors: the root of all of them
    "ReliableAmqpError",
    # ... raised by a call: bad input or options, timeouts, misuse
    "ConfigurationError", "InvalidMessage", "BrokerLimitExceeded", "PublishTimeout",
    "OperationTimeout",
    "MissingMessageId",
    "WouldDeadlock", "PublisherForked",
    # ... the connection
    "AmqpConnectionError", "AuthenticationFailed", "TlsError", "RecoveryFailed",
    # ... what the broker closed a channel or connection with, by reply code (311 ... 541)
    "BrokerError",
    "ContentTooLarge", "NoRoute", "NoConsumers", "ConnectionForced",
    "AccessRefused", "NotFound", "ResourceLocked", "PreconditionFailed",
    "FrameError", "AmqpSyntaxError", "CommandInvalid", "ChannelError", "UnexpectedFrame",
    "ResourceError", "NotAllowed", "AmqpNotImplemented", "InternalError",
    # ... one message not confirmed: each carries the message
    "PublishError",
    "MessageNacked", "MessageReturned", "MessageRejected", "DeliveryTimeout", "PublisherClosed",
    # ... the durable spool
    "SpoolError", "SpoolWriteError", "SpoolFull",
    # ... an installed pika / aio-pika / aiormq lacks what this library relies on
    "IncompatibleDependency",
]
# fmt: on


def __getattr__(name: str) -> object:
    # AsyncPublisher needs the `aio` extra: aio-pika is imported only when it is asked for.
    if name == "AsyncPublisher":
        from reliable_amqp._async import AsyncPublisher

        return AsyncPublisher
    raise AttributeError(f"module 'reliable_amqp' has no attribute {name!r}")


def __dir__() -> list[str]:
    # exactly __all__ (AsyncPublisher among it, though loaded on first use): not the helpers of
    # this module nor the private submodules
    return sorted(__all__)
