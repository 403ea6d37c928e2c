"""A partitioned consumer's I/O: its membership in the group and the partitions it holds.

``Consumer(url, NAME, partitions=N)`` builds a :class:`PartitionGroup` where a plain consumer
builds one :class:`~reliable_amqp._consume._io.ConsumerIO`. The group's own thread keeps a
connection to the broker on which it declares the topology (with ``declare=True``), holds this
process's membership (a consumer on ``NAME.members``) and its partitions' locks, and every
``interval`` seconds looks at who holds which partition and acts on
:func:`reliable_amqp._core.partitions.plan`:

- a partition is taken by taking its lock first: the *exclusive* queue ``NAME.<i>.lock``,
  declared on the group's connection (the broker refuses it to any other connection with 405,
  and deletes it with its connection: a member killed -9, or one whose node died, loses its
  locks at once). Then the partition queue itself is consumed by a :class:`ConsumerIO` of its
  own (its own connection and thread). The partition queues are declared with *single active
  consumer*, so even while two members believe they hold one (a member cut off, not yet
  noticed), the broker delivers to one of them at a time, and to the next only once the first
  one's channel is gone.
- a partition given up (the group grew, a starving member asked) is
  *released*: no further delivery of it reaches the handlers, those already handed over are
  finished and acked, then its connection closes, then its lock. What it still held goes back
  to the queue as its subscription ends, so the next member starts exactly where this one
  stopped;
- a partition whose connection died is dropped: the deliveries of its dead channel are stale,
  never handled here again.

Settlements find their partition by the delivery's generation: every channel of every partition
gets a generation from one counter, so a generation names one channel for good.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions

from reliable_amqp._consume._attempts import Attempts
from reliable_amqp._consume._group_view import Counts, GroupView, hash_missing
from reliable_amqp._consume._io import ConsumerIO
from reliable_amqp._consume._lifecycle import node_of, product_of
from reliable_amqp._core.acks import ACK
from reliable_amqp._core.delivery import Delivery
from reliable_amqp._core.errors import ReliableAmqpError, broker_error
from reliable_amqp._core.partitions import partition_queue, plan
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._logs import own_context
from reliable_amqp._sync._pika import translate_connection_error

if TYPE_CHECKING:
    from reliable_amqp._consume._lifecycle import Lifecycle

log = logging.getLogger("reliable_amqp")

#: how often (s) a member looks at the group: a partition freed by a dead member is taken
#: within about this long (plus the broker noticing the death: at once for a killed process)
DEFAULT_INTERVAL = 1.0


class PartitionGroup:
    """This process's member of a partitioned consumer's group (see the module docstring)."""

    def __init__(
        self,
        params: list[pika.URLParameters],
        queue: str,
        *,
        prefetch: int,
        connect_policy: RetryPolicy,
        on_deliveries: Callable[[list[Delivery]], None],
        declare: dict[str, Any] | None,
        consumer_arguments: dict[str, Any],
        lifecycle: Lifecycle,
        partitions: int,
        stop_timeout: float = 30.0,
        interval: float = DEFAULT_INTERVAL,
        keep: Callable[[], set[int]] | None = None,
    ) -> None:
        self._params = params
        self.queue = queue
        self.prefetch = prefetch
        self.partitions = partitions
        self._policy = connect_policy
        self._on_deliveries = on_deliveries
        self._declare = declare
        self._consumer_arguments = consumer_arguments
        self._lifecycle = lifecycle
        self._stop_timeout = stop_timeout
        self._interval = interval
        #: partitions not to give up now (their keys wait for a retry in this process)
        self.keep = keep or set
        self.ended = threading.Event()
        self.consuming = threading.Event()
        self.fatal: ReliableAmqpError | None = None
        self.node: str | None = None
        self.server_properties: Mapping[str, Any] | None = None
        #: lost group connections counted against the connect policy (as a ConsumerIO's)
        self._attempts = Attempts(connect_policy)
        self._stale = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._generations = itertools.count(1)
        self._owner: dict[int, int] = {}  # generation -> partition
        self._owner_lock = threading.Lock()
        self._ios: dict[int, ConsumerIO] = {}  # partition -> its I/O (held or being released)
        # partition being given up -> its deliveries left unacked since (not handed over, or
        # handed over and not started): what it holds beyond them is running or settling
        self._releasing: dict[int, int] = {}
        self._release_by: dict[int, float] = {}
        self._forward_lock = threading.Lock()
        self._view: GroupView | None = None
        self._rng = random.Random()
        self._looked = False  # a round saw every queue of the group (this run)
        self._wait_unsubscribed = False  # (LavinMQ) take no partition that has a consumer
        #: partition -> monotonic time it was taken (for tests and take-over times)
        self.taken_at: dict[int, float] = {}

    # --- ConsumerLink -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the group's connection is open."""
        view = self._view
        return view is not None and view.is_open

    @property
    def held(self) -> list[int]:
        """The partitions this member holds now (subscribed or subscribing), not those being
        given up."""
        return sorted(
            p
            for p, io in list(self._ios.items())
            if p not in self._releasing and not io.ended.is_set()
        )

    @property
    def recoveries(self) -> int:
        """Group connections got back after a loss."""
        return self._attempts.recoveries

    @property
    def last_delivery(self) -> float | None:
        """The latest delivery over every partition held."""
        times = [io.last_delivery for io in list(self._ios.values()) if io.last_delivery]
        return max(times) if times else None

    @property
    def stale_settlements(self) -> int:
        """Settlements dropped (their channel died), over every partition."""
        return self._stale + sum(io.stale_settlements for io in list(self._ios.values()))

    @property
    def unacked(self) -> int:
        """Deliveries unsettled over every partition held."""
        return sum(io.unacked for io in list(self._ios.values()))

    def is_live(self, generation: int) -> bool:
        """Whether a delivery of ``generation`` may start: its channel is open and its
        partition is not being given up. (Called once per delivery, as its handler is about
        to start: one refused for a partition being given up is counted, as it stays unacked
        until the partition closes and goes back to the queue then.)"""
        partition = self._owner.get(generation)
        io = None if partition is None else self._ios.get(partition)
        if io is None or not io.is_live(generation):
            return False
        with self._forward_lock:
            if partition in self._releasing:
                self._releasing[partition] += 1
                return False
        return True

    def start(self) -> None:
        """Join the group (again, after a run that ended)."""
        if self._thread is not None and self._thread.is_alive():
            raise ReliableAmqpError("the consumer's group thread is still running")
        self._stopping.clear()
        self.ended.clear()
        self.consuming.clear()
        self.fatal = None
        self._looked = False
        self._thread = threading.Thread(
            target=self._run, name="reliable-amqp-consume-group", daemon=True
        )
        self._thread.start()

    def settle(self, generation: int, tag: int, kind: int = ACK, urgent: bool = False) -> None:
        """Route a settlement to the partition whose channel ``generation`` is."""
        io = self._io_of(generation)
        if io is None:
            self._stale += 1
            return
        io.settle(generation, tag, kind, urgent)

    def flush(self) -> None:
        """Send every settlement due, on every partition."""
        for io in list(self._ios.values()):
            io.flush()

    def cancel(self) -> None:
        """Stop handing deliveries over: every partition is being given up (its subscription
        stays until :meth:`drain`, so no other member starts on it before this one is done)."""
        with self._forward_lock:
            for partition in self._ios:
                self._releasing.setdefault(partition, 0)
        self._stopping.set()

    def drain(self, timeout: float) -> bool:
        """Give every partition up: settlements out, then each connection closed (what was
        not handled goes back to its queue as the subscription ends)."""
        self.cancel()
        deadline = time.monotonic() + timeout
        ok = True
        for partition, io in list(self._ios.items()):
            ok = io.release(max(0.1, deadline - time.monotonic())) and ok
            self._forget(partition)
        return ok

    def stop(self, timeout: float | None = None) -> None:
        """Leave the group: close every partition's connection and the group's own."""
        self._stopping.set()
        if self._thread is not None:  # first: it takes no partition once it has ended
            self._thread.join(timeout)
        for partition, io in list(self._ios.items()):
            io.stop(timeout=2.0)
            self._forget(partition)

    # --- routing ------------------------------------------------------------------------------

    def _io_of(self, generation: int) -> ConsumerIO | None:
        partition = self._owner.get(generation)
        return None if partition is None else self._ios.get(partition)

    def _generation_for(self, partition: int) -> int:
        with self._owner_lock:
            generation = next(self._generations)
            self._owner[generation] = partition
        return generation

    def _forward(self, partition: int, batch: list[Delivery]) -> None:
        # On the partition's I/O thread: a partition being given up hands nothing more over
        # (what it holds goes back to the queue when it closes).
        with self._forward_lock:
            if partition in self._releasing:
                self._releasing[partition] += len(batch)
                return
        self._on_deliveries(batch)

    # --- the group's thread -------------------------------------------------------------------

    def _run(self) -> None:
        own_context()
        try:
            self._loop()
        except ReliableAmqpError as exc:
            self.fatal = exc
        except BaseException as exc:  # a bug must not leave run() waiting forever
            log.exception("reliable-amqp: consumer group thread failed")
            self.fatal = ReliableAmqpError(f"internal error in the consumer's group: {exc!r}")
        finally:
            if not self._stopping.is_set():  # ended by an error: the partitions end with it
                for io in list(self._ios.values()):
                    io.stop(timeout=2.0)
            # (asked to stop: drain() or stop() gives the partitions up, acks first)
            self.consuming.clear()
            self._close_view()
            self.ended.set()

    def _loop(self) -> None:
        attempts = self._attempts
        attempts.reset()
        index = 0
        while not self._stopping.is_set():
            params = self._params[index % len(self._params)]
            index += 1
            try:
                self._member(params)
                return
            except pika.exceptions.ChannelClosedByBroker as exc:
                # a refusal of what the group declares or looks at (406: a partition queue
                # declared with other arguments, 403, 404 before any round): not for retrying
                if self._looked and exc.reply_code == 404:
                    loss: ReliableAmqpError = broker_error(exc.reply_code, exc.reply_text)
                else:
                    view = self._view
                    raise (
                        view.refused(exc)
                        if view is not None
                        else broker_error(exc.reply_code, exc.reply_text)
                    ) from None
            except (pika.exceptions.AMQPError, OSError) as exc:
                loss = translate_connection_error(exc, params)
                missing = hash_missing(loss)
                if missing is not None:
                    raise missing from None
                if not loss.retriable:
                    raise loss from exc
            self.consuming.clear()
            self._close_view()
            if self._stopping.is_set():
                return
            if not attempts.count(loss):
                raise attempts.gave_up(self.queue, loss)
            delay = attempts.delay()
            log.warning(
                "reliable-amqp: consumer group %r lost its view of the group (%s); trying again "
                "in %.1f s (the partitions it holds are consumed meanwhile)",
                self.queue,
                loss,
                delay,
            )
            if self._stopping.wait(delay):
                return

    def _member(self, params: pika.URLParameters) -> None:
        """Connect, declare, join, then look at the group every interval until stopped."""
        view = GroupView(params, self.queue, self.partitions, self._declare)
        self._view = view
        self.node = node_of(params.host, params.port)
        self.server_properties = view.server_properties
        product = product_of(self.server_properties)
        self._lifecycle.connected(self.node, product)
        # LavinMQ hands a single-active-consumer queue to a consumer already waiting before
        # it requeues what the closed one held (docs/brokers.md): a partition that still has a
        # consumer without a lock (a member cut off, not yet noticed by the broker, or this
        # member's own lost partition connection) is not taken until that consumer is gone, and
        # a partition whose connection is lost ends rather than subscribing again behind the
        # old consumer (_take). (RabbitMQ keeps that hand-over's order.)
        self._wait_unsubscribed = product.startswith("LavinMQ")
        view.join()
        for partition in self.held:  # consumed meanwhile: locked again, or given up
            if not view.lock(partition):
                self._release(partition, 0, "its lock was taken while this member was away")
        self._lifecycle.subscribed(self.node, None, 0, 0.0, self.server_properties)
        self._attempts.recovered()  # an outage is counted on its own, not with earlier ones
        self.consuming.set()
        while not self._stopping.is_set():
            self._regain(view)
            counts = view.counts()
            self._looked = True
            view.want(self._round(counts))
            pause = self._interval * self._rng.uniform(0.8, 1.2)
            view.wait(min(pause, 0.05) if self._releasing else pause)

    def _regain(self, view: GroupView) -> None:
        """Lock again what the broker deleted under this member (another connection had been
        granted the same lock: GroupView._claim), or give it up if another member took it."""
        if not view.lost:
            return
        for partition in view.regain():
            if partition not in self.held:
                continue  # being given up, or gone already
            if view.lock(partition):
                log.info(
                    "reliable-amqp: consumer group %r locked partition %r again",
                    self.queue,
                    partition_queue(self.queue, partition),
                )
                continue
            log.warning(
                "reliable-amqp: consumer group %r lost the lock of partition %r to another "
                "member (the broker had granted it to both); giving the partition up",
                self.queue,
                partition_queue(self.queue, partition),
            )
            self._release(partition, 0, "its lock went to another member")

    def _close_view(self) -> None:
        view, self._view = self._view, None
        self.node = None
        if view is not None:
            view.close()

    def _round(self, counts: Counts) -> bool:
        """One look at the group: settle what ended, release what is due, act on the plan.
        True when this member wants a partition it cannot get."""
        members, wanting, per = counts.members, counts.wanting, counts.locked
        self._reap()
        self._finish_releases()
        view = self._view
        if view is not None and view.slot is None:
            view.take_slot()  # a spare: a slot may have been freed (a member gone)
            if view.slot is None:
                return False
        mine = self.held
        busy = set(self._releasing)
        free = [i for i, n in enumerate(per) if n == 0 and i not in mine and i not in busy]
        if self._wait_unsubscribed and counts.subscribed:
            free = [i for i in free if counts.subscribed[i] == 0]
        step = plan(self.partitions, members, mine, free, wanting, keep=self.keep(), rng=self._rng)
        for partition in step.take:
            self._take(partition, members)
        for partition in step.release:
            self._release(partition, members, "to rebalance")
        return step.want

    def _take(self, partition: int, members: int) -> None:
        if self._stopping.is_set():  # stopping: drain() and stop() see what is held now
            return
        if self._view is None or not self._view.lock(partition):
            return  # another member took it first
        io = ConsumerIO(
            self._params,
            partition_queue(self.queue, partition),
            prefetch=self.prefetch,
            connect_policy=self._policy,
            on_deliveries=lambda batch, p=partition: self._forward(p, batch),  # type: ignore[misc]
            consumer_arguments=self._consumer_arguments,
            generations=lambda p=partition: self._generation_for(p),  # type: ignore[misc]
            careful_start=False,  # single active consumer: a cancel would hand it over
            # LavinMQ: a lost connection ends the partition here, and a later round takes it
            # again only once the broker has let the old consumer go (its unacked requeued
            # first), not a new connection subscribing beside the old one (docs/brokers.md)
            reconnect=not self._wait_unsubscribed,
        )
        self._ios[partition] = io
        self.taken_at[partition] = time.monotonic()
        io.start()
        log.info(
            "reliable-amqp: consumer group %r takes partition %r (%d member(s), holding %d of %d)",
            self.queue,
            io.queue,
            members,
            len(self.held),
            self.partitions,
        )

    def _release(self, partition: int, members: int, why: str) -> None:
        with self._forward_lock:
            self._releasing[partition] = 0
        self._release_by[partition] = time.monotonic() + self._stop_timeout
        log.info(
            "reliable-amqp: consumer group %r gives up partition %r %s (%d member(s))",
            self.queue,
            partition_queue(self.queue, partition),
            why,
            members,
        )

    def _finish_releases(self) -> None:
        """Close each partition being given up once what it handed over is settled."""
        for partition in list(self._releasing):
            io = self._ios.get(partition)
            if io is None:
                continue
            io.flush()
            outstanding = io.unacked - self._releasing[partition]
            late = time.monotonic() >= self._release_by.get(partition, 0.0)
            if outstanding > 0 and not late:
                continue
            if outstanding > 0:
                log.warning(
                    "reliable-amqp: consumer group %r gives up partition %r with %d handler(s) "
                    "still running after stop_timeout=%.0f s: their messages go back to the "
                    "queue and may run again, beside the next holder's",
                    self.queue,
                    io.queue,
                    outstanding,
                    self._stop_timeout,
                )
            io.release(timeout=5.0)
            self._forget(partition)

    def _reap(self) -> None:
        """Forget partitions whose I/O ended: taken by another member, or failed for good."""
        for partition, io in list(self._ios.items()):
            if not io.ended.is_set() or partition in self._releasing:
                continue
            self._forget(partition)
            if io.fatal is None and not self._stopping.is_set():
                log.info(
                    "reliable-amqp: consumer group %r lost partition %r with its connection "
                    "(%s); taking it again once the broker has no consumer on it",
                    self.queue,
                    io.queue,
                    io.attempts.last_loss,
                )
            if io.fatal is not None and not self._stopping.is_set():
                # a refusal (permissions), a queue gone for good, a spent connect policy: the
                # member cannot consume its share, so it ends (loud), rather than retake and
                # lose the partition every second
                raise io.fatal

    def _forget(self, partition: int) -> None:
        io = self._ios.pop(partition, None)
        with self._forward_lock:
            self._releasing.pop(partition, None)
        self._release_by.pop(partition, None)
        self.taken_at.pop(partition, None)
        view = self._view
        if view is not None and threading.current_thread() is self._thread:
            view.unlock(partition)  # (the group's connection is its thread's alone)
        if io is not None:
            self._stale += io.stale_settlements
            with self._owner_lock:
                for generation in [g for g, p in self._owner.items() if p == partition]:
                    del self._owner[generation]
