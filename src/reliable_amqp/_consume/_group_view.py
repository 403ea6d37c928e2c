"""The broker as a partitioned consumer's group sees it: one connection, its declarations,
membership, partition locks and the counts every round reads.

:class:`GroupView` runs on the group's thread only (a pika ``BlockingConnection`` is not
thread-safe); :class:`~reliable_amqp._consume._group.PartitionGroup` decides what to do with
what it reads. See :mod:`reliable_amqp._core.partitions` for the names and the rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions

from reliable_amqp._core.errors import ConfigurationError, ReliableAmqpError, broker_error
from reliable_amqp._core.partitions import (
    BINDING_WEIGHT,
    HASH_EXCHANGE_TYPE,
    HASH_PLUGIN,
    SAC,
    lock_queue,
    members_queue,
    partition_queue,
    wanting_queue,
)
from reliable_amqp._core.refusals import QueueNotFound, refusal


@dataclass(frozen=True)
class Counts:
    """One round's reading: live members, starving members, each partition's lock holders."""

    members: int
    wanting: int
    locked: list[int]


class GroupView:
    """The group's connection to the broker (see the module docstring)."""

    def __init__(
        self,
        params: pika.URLParameters,
        name: str,
        partitions: int,
        declare: Mapping[str, Any] | None,
    ) -> None:
        self.name = name
        self.partitions = partitions
        self._declare = declare
        self.connection = pika.BlockingConnection(params)
        self.server_properties: Mapping[str, Any] = self.connection._impl.server_properties
        self._channel = self.connection.channel()
        self._locks: dict[int, Any] = {}  # partition -> the channel holding its lock
        #: partitions whose lock queue went (its node is down): to give up
        self.lock_lost: set[int] = set()
        self._want_tag: str | None = None

    def join(self) -> None:
        """Declare (with ``declare``) the topology, then become a member."""
        channel = self._channel
        if self._declare is not None:
            declare = dict(self._declare)
            # single active consumer: whatever a member believes, the broker delivers a
            # partition to one consumer at a time, and to the next once that one's channel is
            # gone
            declare["arguments"] = {**(declare.get("arguments") or {}), SAC: True}
            channel.exchange_declare(self.name, HASH_EXCHANGE_TYPE, durable=True)
            for index in range(self.partitions):
                queue = partition_queue(self.name, index)
                channel.queue_declare(queue, **declare)
                channel.queue_bind(queue, self.name, routing_key=BINDING_WEIGHT)
        members = members_queue(self.name)
        for queue in (members, wanting_queue(self.name)):
            self._declare_own(queue)
        channel.basic_consume(members, _never, auto_ack=True)

    def counts(self) -> Counts:
        """Read the group: every partition queue must exist; the library's own queues are
        declared, not looked up (an auto-delete queue goes with its last consumer: the
        wanting queue whenever no member starves, a lock queue whenever it is free)."""
        members = self._declare_own(members_queue(self.name))
        wanting = self._declare_own(wanting_queue(self.name))
        for index in range(self.partitions):
            self._channel.queue_declare(partition_queue(self.name, index), passive=True)
        locks = [self._declare_own(lock_queue(self.name, i)) for i in range(self.partitions)]
        return Counts(
            members.method.consumer_count,
            wanting.method.consumer_count,
            [ok.method.consumer_count for ok in locks],
        )

    def want(self, wanting: bool) -> None:
        """Say (or stop saying) that this member starves: a consumer on the wanting queue."""
        if wanting and self._want_tag is None:
            self._want_tag = self._channel.basic_consume(
                wanting_queue(self.name), _never, auto_ack=True
            )
        elif not wanting and self._want_tag is not None:
            self._channel.basic_cancel(self._want_tag)
            self._want_tag = None

    def lock(self, partition: int) -> bool:
        """Take ``partition``'s lock: an exclusive consumer on its lock queue, on a channel of
        its own (a refusal closes the channel). False: another member holds it."""
        channel = self.connection.channel()
        try:
            channel.basic_consume(
                lock_queue(self.name, partition), _never, auto_ack=True, exclusive=True
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code in (403, 405):  # held by another member
                return False
            raise
        channel.add_on_cancel_callback(lambda _frame: self.lock_lost.add(partition))
        self._locks[partition] = channel
        return True

    def unlock(self, partition: int) -> None:
        """Let ``partition``'s lock go (after its consumer closed)."""
        channel = self._locks.pop(partition, None)
        self.lock_lost.discard(partition)
        if channel is not None and channel.is_open:
            with contextlib.suppress(Exception):
                channel.close()

    def wait(self, seconds: float) -> None:
        """Serve the connection (heartbeats, cancels) for ``seconds``."""
        self.connection.process_data_events(time_limit=seconds)

    @property
    def is_open(self) -> bool:
        """Whether the connection is open."""
        return bool(self.connection.is_open)

    def close(self) -> None:
        """Close the connection (every lock and the membership go with it)."""
        with contextlib.suppress(Exception):
            self.connection.close()

    def refused(self, exc: pika.exceptions.ChannelClosedByBroker) -> ReliableAmqpError:
        """The broker's refusal of the group's set-up, naming the remedy."""
        if exc.reply_code == 404:
            return QueueNotFound(
                404,
                f"{exc.reply_text}: the partition queues of {self.name!r} "
                f"({partition_queue(self.name, 0)!r}.."
                f"{partition_queue(self.name, self.partitions - 1)!r}) must exist; "
                "declare=True declares them, the consistent-hash exchange and its bindings",
            )
        params = self.connection._impl.params
        better = refusal(
            exc.reply_code,
            exc.reply_text,
            operation="queue.declare",
            name=self.name,
            vhost=params.virtual_host,
            user=str(getattr(params.credentials, "username", "")),
        )
        return better or broker_error(exc.reply_code, exc.reply_text)

    def _declare_own(self, name: str) -> Any:
        """Declare one of the group's own queues (auto-delete, classic: a quorum queue ignores
        exclusive consumers).

        Its ``x-max-length`` is the number of partitions (the queue never holds a message):
        the broker refuses a member that counts the partitions otherwise (406), which would
        share them wrongly and leave some unconsumed."""
        try:
            return self._channel.queue_declare(
                name,
                auto_delete=True,
                arguments={"x-max-length": self.partitions, "x-queue-type": "classic"},
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 406:  # (RabbitMQ names x-max-length, LavinMQ no argument)
                raise ConfigurationError(
                    f"the consumer group {self.name!r} has members with another number of "
                    f"partitions than this one's partitions={self.partitions} (the broker: "
                    f"{exc.reply_text}); every member of a group must give the same number"
                ) from None
            raise


def hash_missing(loss: ReliableAmqpError) -> ReliableAmqpError | None:
    """The broker does not know the consistent-hash exchange type: say which plugin."""
    text = str(loss)
    if "x-consistent-hash" not in text and "exchange type" not in text:
        return None
    return ConfigurationError(
        f"the broker does not know the exchange type {HASH_EXCHANGE_TYPE!r} ({text}): "
        f"enable its plugin with 'rabbitmq-plugins enable {HASH_PLUGIN}' (RabbitMQ; LavinMQ "
        "has it built in)"
    )


def _never(*_args: Any) -> None:  # pragma: no cover - the group queues get no messages
    """The callback of the membership consumers (their queues never hold a message)."""
