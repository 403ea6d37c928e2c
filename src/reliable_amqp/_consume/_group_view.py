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
    config_queue,
    lock_queue,
    member_queue,
    partition_queue,
    wanting_queue,
)
from reliable_amqp._core.refusals import QueueNotFound
from reliable_amqp._sync._pika import refusal_at


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
        #: this member's slot (its exclusive queue ``NAME.member.<slot>``), None: the group
        #: has as many members as partitions already (this one waits as a spare)
        self.slot: int | None = None
        self._wanting = False

    def join(self) -> None:
        """Declare (with ``declare``) the topology, check the group's number of partitions,
        then take a member's slot if one is free."""
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
        self._check_partitions()
        self.take_slot()

    def take_slot(self) -> None:
        """Hold the lowest free member slot (a spare tries again each round)."""
        if self.slot is not None:
            return
        for slot in range(self.partitions):
            if self._exclusive(member_queue(self.name, slot)):
                self.slot = slot
                return

    def counts(self) -> Counts:
        """Read the group: every partition queue must exist; members, starving members and
        partition locks are exclusive queues, held (405 to anyone else), free (404) or ours."""
        for index in range(self.partitions):
            self._channel.queue_declare(partition_queue(self.name, index), passive=True)
        slots = [self._probe(member_queue(self.name, s)) for s in range(self.partitions)]
        locked = [self._probe(lock_queue(self.name, i)) for i in range(self.partitions)]
        members = sum(slots)
        wanting = 0
        if all(locked):  # a member starves only while nothing is free
            wanting = sum(
                self._probe(wanting_queue(self.name, s)) for s in range(self.partitions) if slots[s]
            )
        return Counts(max(1, members), wanting, [int(x) for x in locked])

    def want(self, wanting: bool) -> None:
        """Say (or stop saying) that this member starves: its exclusive wanting queue."""
        if self.slot is None or wanting == self._wanting:
            return
        queue = wanting_queue(self.name, self.slot)
        if wanting:
            self._wanting = self._exclusive(queue)
        else:
            self._channel.queue_delete(queue)
            self._wanting = False

    def lock(self, partition: int) -> bool:
        """Take ``partition``'s lock: its exclusive lock queue (refused with 405 while another
        member's connection holds it). False: another member holds it."""
        return self.slot is not None and self._exclusive(lock_queue(self.name, partition))

    def unlock(self, partition: int) -> None:
        """Let ``partition``'s lock go (after its consumer closed)."""
        with contextlib.suppress(pika.exceptions.AMQPError):
            self._channel.queue_delete(lock_queue(self.name, partition))

    def _exclusive(self, name: str) -> bool:
        """Declare ``name`` exclusive to this connection; False when another holds it."""
        try:
            self._channel.queue_declare(name, exclusive=True, auto_delete=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = self.connection.channel()
            if exc.reply_code in (403, 405):  # another connection's
                return False
            raise
        return True

    def _probe(self, name: str) -> int:
        """1 when ``name`` (an exclusive queue) is held, by anyone; 0 when free."""
        try:
            self._channel.queue_declare(name, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = self.connection.channel()
            if exc.reply_code == 404:
                return 0
            if exc.reply_code in (403, 405):  # another connection's
                return 1
            raise
        return 1

    def _check_partitions(self) -> None:
        """The group's record of its number of partitions (a durable queue whose
        ``x-max-length`` is that number: the broker refuses another with 406). A record the
        broker cannot reach now (its node down) is not checked."""
        try:
            self._channel.queue_declare(
                config_queue(self.name),
                durable=True,
                arguments={"x-max-length": self.partitions, "x-queue-type": "classic"},
            )
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = self.connection.channel()
            if exc.reply_code == 406:  # (RabbitMQ names x-max-length, LavinMQ no argument)
                raise ConfigurationError(
                    f"the consumer group {self.name!r} has another number of partitions than "
                    f"this one's partitions={self.partitions} (the broker: {exc.reply_text}); "
                    f"every member of a group must give the same number (to change it, stop "
                    f"every member and delete the queue {config_queue(self.name)!r})"
                ) from None
            if exc.reply_code != 404:  # 404: its node is down
                raise

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
        better = refusal_at(
            self.connection._impl.params,
            exc.reply_code,
            exc.reply_text,
            operation="queue.declare",
            name=self.name,
        )
        return better or broker_error(exc.reply_code, exc.reply_text)


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
