"""The broker as a partitioned consumer's group sees it: one connection, its declarations,
membership, partition locks and the counts every round reads.

:class:`GroupView` runs on the group's thread only (a pika ``BlockingConnection`` is not
thread-safe); :class:`~reliable_amqp._consume._group.PartitionGroup` decides what to do with
what it reads. See :mod:`reliable_amqp._core.partitions` for the names and the rule.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingChannel

from reliable_amqp._consume._lifecycle import product_of
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

log = logging.getLogger("reliable_amqp")

#: how often (s) the group's thread looks, while it waits, whether the broker took a slot or
#: a lock from under it (see GroupView.lost)
LOST_CHECK = 0.05


@dataclass(frozen=True)
class Counts:
    """One round's reading: live members, starving members, each partition's lock holders."""

    members: int
    wanting: int
    locked: list[int]
    #: consumers on each partition queue (a classic queue counts every consumer subscribed, a
    #: quorum queue on RabbitMQ the active one)
    subscribed: list[int] = field(default_factory=list)


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
        #: the slot and the locks this member holds: queue -> the channel of its *hold*, a
        #: consumer on that queue (see :meth:`_claim`)
        self._holds: dict[str, BlockingChannel] = {}
        #: held queues the broker deleted under this member (another connection that had been
        #: granted the same exclusive queue gave it up): :meth:`regain` takes them again
        self.lost: list[str] = []
        self._said_shared = False  # the first shared grant is a WARNING, the next ones INFO

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
            if self._claim(member_queue(self.name, slot)):
                self.slot = slot
                return

    def counts(self) -> Counts:
        """Read the group: every partition queue must exist; members, starving members and
        partition locks are exclusive queues, held (405 to anyone else), free (404) or ours."""
        subscribed = [
            int(
                self._channel.queue_declare(
                    partition_queue(self.name, index), passive=True
                ).method.consumer_count
            )
            for index in range(self.partitions)
        ]
        slots = [self._probe(member_queue(self.name, s)) for s in range(self.partitions)]
        locked = [self._probe(lock_queue(self.name, i)) for i in range(self.partitions)]
        members = sum(slots)
        wanting = 0
        if all(locked):  # a member starves only while nothing is free
            wanting = sum(
                self._probe(wanting_queue(self.name, s)) for s in range(self.partitions) if slots[s]
            )
        return Counts(max(1, members), wanting, [int(x) for x in locked], subscribed)

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
        return self.slot is not None and self._claim(lock_queue(self.name, partition))

    def unlock(self, partition: int) -> None:
        """Let ``partition``'s lock go (after its consumer closed)."""
        name = lock_queue(self.name, partition)
        self._unhold(name)
        self._delete(name)

    def regain(self) -> list[int]:
        """Take back the slot if the broker deleted it under this member (:attr:`lost`), and
        return the partitions whose lock it deleted (the group locks those it still holds
        again, or gives them up)."""
        lost, self.lost = self.lost, []
        locks = {lock_queue(self.name, i): i for i in range(self.partitions)}
        partitions = []
        for name in lost:
            self._unhold(name)
            if self.slot is not None and name == member_queue(self.name, self.slot):
                self.want(False)
                self.slot = None
                self.take_slot()
            elif name in locks:
                partitions.append(locks[name])
        return partitions

    def _claim(self, name: str) -> bool:
        """Hold ``name`` (a slot or a lock): declare it exclusive, then check that no other
        connection was granted it too.

        LavinMQ 2.9.1 grants a new exclusive queue to every connection whose declaration comes
        while the first one is being created (``Client#declare_new_queue`` takes the queue the
        other connection made as its own: docs/brokers.md). So each holder also consumes from
        what it holds (its *hold*, on a channel of its own), then reads the queue's consumer
        count: of two connections granted one queue, at most one counts 1 (each counts after its
        own consumer is on), and any that counts more gives the queue up and deletes it, which
        ends the other's claim too (its hold is cancelled: :attr:`lost`, taken back by
        :meth:`regain`).
        """
        if name in self._holds:  # already ours (the group looks again after a reconnect)
            return True
        if not self._exclusive(name):
            return False
        hold = self.connection.channel()
        hold.add_on_cancel_callback(lambda _frame: self._cancelled(name, hold))
        try:
            hold.basic_consume(name, _never, auto_ack=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code not in (403, 404, 405):  # deleted by the other holder already
                raise
            return False
        self._holds[name] = hold
        count = self._consumers(name)
        if count == 1:
            return True
        if count > 1:
            log.log(
                logging.INFO if self._said_shared else logging.WARNING,
                "reliable-amqp: consumer group %r: the broker (%s) granted the exclusive queue "
                "%r to this member and to another connection at once (%d holders); this member "
                "gives it up (LavinMQ 2.9.1 does so when two declarations of a new exclusive "
                "queue meet: see docs/brokers.md)",
                self.name,
                product_of(self.server_properties) or "?",
                name,
                count,
            )
            self._said_shared = True
        # (0: the other holder gave it up first, and deleted it)
        self._unhold(name)
        self._delete(name)
        return False

    def _cancelled(self, name: str, hold: BlockingChannel) -> None:
        """(pika's callback) The broker cancelled a hold: its queue was deleted."""
        if self._holds.get(name) is hold:
            self.lost.append(name)

    def _unhold(self, name: str) -> None:
        """End the hold of ``name`` (its channel closes with its consumer)."""
        hold = self._holds.pop(name, None)
        if hold is not None and hold.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                hold.close()

    def _delete(self, name: str) -> None:
        """Delete ``name`` if it is this connection's (another connection's: left alone)."""
        try:
            self._channel.queue_delete(name)
        except pika.exceptions.ChannelClosedByBroker:
            self._channel = self.connection.channel()
        except pika.exceptions.AMQPError:
            pass  # the connection is going: the group's loop notices

    def _consumers(self, name: str) -> int:
        """The consumer count of ``name`` (0: it is gone)."""
        try:
            return int(self._channel.queue_declare(name, passive=True).method.consumer_count)
        except pika.exceptions.ChannelClosedByBroker as exc:
            self._channel = self.connection.channel()
            if exc.reply_code in (403, 404, 405):  # gone, or another connection's now
                return 0
            raise

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
        """Serve the connection (heartbeats, cancels) for ``seconds``, or until the broker
        takes a slot or a lock from under this member (:attr:`lost`)."""
        deadline = time.monotonic() + seconds
        while not self.lost:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.connection.process_data_events(time_limit=min(left, LOST_CHECK))

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
