"""The consuming half: :class:`Consumer` (sync) and :class:`AsyncConsumer` (asyncio).

Both share one connection machinery (an I/O thread that decodes deliveries itself and sends
batched acks) and one redelivery path (retries and dead letters published with confirms before
the original is acked); they differ in how handlers are called. See docs/consumer.md.
"""

from reliable_amqp._consume._dispatch import Reject
from reliable_amqp._consume._health import ConsumerHealth
from reliable_amqp._consume._stats import ConsumerStats
from reliable_amqp._consume.async_consumer import AsyncConsumer, HandlerCancelled, HandlerTimeout
from reliable_amqp._consume.consumer import Consumer

__all__ = [
    "AsyncConsumer",
    "Consumer",
    "ConsumerHealth",
    "ConsumerStats",
    "HandlerCancelled",
    "HandlerTimeout",
    "Reject",
]
