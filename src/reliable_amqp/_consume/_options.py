"""A consumer's options: its own, and the connection options it shares with the publishers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.order import key_reader
from reliable_amqp._core.partitions import check_partitions, partition_queues
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.redelivery import delay_levels, delay_queue

#: the prefetch when none is given: enough to keep a fast handler busy on a quorum queue (which
#: wants 100 or more), small enough that a slow one holds few messages; see docs/consumer.md
DEFAULT_PREFETCH = 100
#: a failed message is tried 5 times in all, 1, 2, 4, 8 s apart (plus up to 0.5 s of jitter)
DEFAULT_REDELIVERY = RetryPolicy(
    max_attempts=5, initial_delay=1.0, max_delay=300.0, multiplier=2.0, jitter=0.5
)
#: below RabbitMQ's default consumer_timeout (30 min), so the consumer notices first
DEFAULT_HANDLER_TIMEOUT = 25 * 60.0


@dataclass(frozen=True)
class ConsumerOptions:
    """Everything a consumer was configured with (see :class:`reliable_amqp.Consumer`)."""

    queue: str
    prefetch: int = DEFAULT_PREFETCH
    redelivery: RetryPolicy = DEFAULT_REDELIVERY
    dead_letter_queue: str = ""
    stop_timeout: float = 30.0
    handler_timeout: float | None = DEFAULT_HANDLER_TIMEOUT
    declare: bool = False
    queue_arguments: Mapping[str, Any] | None = None
    consumer_arguments: Mapping[str, Any] | None = None
    concurrency: int = 1
    #: ``attempts(delivery) -> int`` for a redelivered delivery: a durable count of its tries
    #: (the inbox's attempts ledger), where the broker gives none (classic queues)
    attempts: Callable[[Any], Any] | None = None
    #: per-key order: "routing_key", "header:<name>" or a callable (delivery) -> str | None
    key: object = None
    #: what a key does after one of its messages was dead-lettered: "continue" or "hold"
    after_dead_letter: str = "continue"
    #: consume the partitions ``<queue>.0`` .. ``<queue>.<N-1>`` of the group ``queue``
    partitions: int | None = None
    connection: PublisherOptions = field(default_factory=lambda: PublisherOptions.create("amqp://"))

    def __post_init__(self) -> None:
        if not isinstance(self.queue, str) or not self.queue:
            raise ConfigurationError(f"queue must be a non-empty string, got {self.queue!r}")
        if self.partitions is not None:
            check_partitions(self.partitions)
        if len(self.queue.encode()) > (200 if self.partitions is None else 190):
            raise ConfigurationError(
                f"queue name {self.queue!r} is too long: its delay and dead-letter queues "
                "add a suffix and must stay within AMQP's 255 bytes"
            )
        if type(self.prefetch) is not int or not 1 <= self.prefetch <= 65535:
            raise ConfigurationError(
                f"prefetch must be an integer from 1 to 65535, got {self.prefetch!r} "
                "(a consumer always sets one: without it RabbitMQ sends everything)"
            )
        if type(self.concurrency) is not int or not 1 <= self.concurrency <= self.prefetch:
            raise ConfigurationError(
                f"concurrency must be an integer from 1 to prefetch ({self.prefetch}), "
                f"got {self.concurrency!r}"
            )
        if self.attempts is not None and not callable(self.attempts):
            raise ConfigurationError(
                f"attempts must be a callable (delivery) -> int, got {self.attempts!r}"
            )
        if not isinstance(self.redelivery, RetryPolicy):
            object.__setattr__(self, "redelivery", RetryPolicy.from_dict(self.redelivery))
        delay_levels(self.redelivery)  # refuses a policy without max_attempts
        for name in ("stop_timeout",):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigurationError(f"{name} must be a number of seconds >= 0, got {value!r}")
        timeout = self.handler_timeout
        if timeout is not None and (
            not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0
        ):
            raise ConfigurationError(
                f"handler_timeout must be > 0 seconds or None, got {timeout!r}"
            )
        key_reader(self.key)  # refuses a bad key option
        if self.after_dead_letter not in ("continue", "hold"):
            raise ConfigurationError(
                f"after_dead_letter must be 'continue' or 'hold', got {self.after_dead_letter!r}"
            )
        if not self.dead_letter_queue:
            object.__setattr__(self, "dead_letter_queue", f"{self.queue}.dead")

    @property
    def max_attempts(self) -> int:
        """How many times a message is tried before it is dead-lettered."""
        attempts = self.redelivery.max_attempts
        assert attempts is not None  # checked in __post_init__
        return attempts

    @property
    def consumed_queues(self) -> list[str]:
        """The queues consumed: ``queue``, or every partition queue of the group ``queue``."""
        if self.partitions is None:
            return [self.queue]
        return partition_queues(self.queue, self.partitions)

    def follow_queue(self, queue: str) -> str:
        """Where a fenced key's later messages from ``queue`` wait: its first delay queue (''
        without retries)."""
        levels = delay_levels(self.redelivery)
        return delay_queue(queue, min(levels)) if levels else ""

    @property
    def own_queues(self) -> tuple[str, ...]:
        """The queues the consumer declares for itself: the dead letters, then one delay queue
        per delay level of ``redelivery`` (per partition, for a partitioned consumer: a retry
        comes back to the partition it left)."""
        levels = delay_levels(self.redelivery)
        delays = [delay_queue(q, level) for q in self.consumed_queues for level in levels]
        return (self.dead_letter_queue, *delays)

    @classmethod
    def create(
        cls, url: str | Sequence[str], queue: str, own: Mapping[str, Any], rest: Mapping[str, Any]
    ) -> ConsumerOptions:
        """The options from a constructor's arguments: ``own`` are the consumer's, ``rest`` the
        connection options :class:`~reliable_amqp.PublisherOptions` takes."""
        connection = PublisherOptions.create(url, **rest)
        return cls(queue=queue, connection=connection, **own)
