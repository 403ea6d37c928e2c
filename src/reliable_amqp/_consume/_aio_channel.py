"""One consuming channel of the async consumer's connection, on the event loop (one generation).

Its set-up is pika's (``channel.open``, ``basic.qos``, ``queue.declare``, ``basic.consume``,
each on the callback of the one before); its deliveries come from the connection's scanner, and
its acks leave as frames :class:`~reliable_amqp._core.acks.AckBook` decides and
:func:`~reliable_amqp._core.acks.encode_ack_frames` encodes, written in one piece. What to do
when the channel closes (a refusal, a retry under the connect policy) is the link's
(:class:`~reliable_amqp._consume._aio_io.LoopConsumerIO`): this class reports it.

The careful start is the sync consumer's (:class:`~reliable_amqp._consume._io.ConsumerIO`): a
new channel consumes one message at a time while the broker redelivers, and the first fresh
delivery opens the full prefetch with a new subscription on the same channel, whose window is
the prefetch less what the first one still holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pika.channel import Channel

from reliable_amqp._compat.pika import LoopScanningConnection, scanner_takes_deliveries
from reliable_amqp._core.acks import AckBook, ack_batch, encode_ack_frames
from reliable_amqp._core.delivery import Delivery, DeliveryScanner

log = logging.getLogger("reliable_amqp")


class Subscription:
    """A consuming channel: its set-up, careful start, ack book, cancel and drain."""

    def __init__(
        self,
        connection: LoopScanningConnection,
        queue: str,
        prefetch: int,
        generation: int,
        *,
        declare: dict[str, Any] | None,
        consumer_arguments: dict[str, Any],
        on_ready: Callable[[Subscription], None],
        on_closed: Callable[[Subscription, Any], None],
    ) -> None:
        self._connection = connection
        self._queue = queue
        self._prefetch = prefetch
        self.generation = generation
        self._declare = declare
        self._consumer_arguments = consumer_arguments
        self._on_ready = on_ready
        self._on_closed = on_closed
        self.book = AckBook(generation, ack_batch(prefetch))
        self.channel: Channel | None = None
        self._consumer_tag: str | None = None
        self._careful = prefetch > 1
        #: the set-up step under way ("queue.declare", "basic.consume"; "" once subscribed)
        self.step = ""
        #: the broker cancelled the subscription (its channel is then closed by us)
        self.cancelled = False
        #: stopping: cancel, ack what finished, requeue the rest; never subscribe again
        self.draining = False

    def open(self) -> None:
        """Open the channel and subscribe (the rest follows on pika's callbacks)."""
        self._connection.channel(on_open_callback=self._on_open)

    @property
    def is_open(self) -> bool:
        """Whether the channel is open."""
        channel = self.channel
        return channel is not None and bool(channel.is_open)

    def _on_open(self, channel: Channel) -> None:
        self.channel = channel
        connection = self._connection
        connection.scanner = DeliveryScanner(channel.channel_number, self.generation, self._queue)
        channel.add_on_close_callback(self._closed)
        channel.add_on_cancel_callback(self._on_server_cancel)
        channel.basic_qos(
            prefetch_count=1 if self._careful else self._prefetch, callback=self._on_qos
        )

    def _on_qos(self, _frame: Any) -> None:
        channel = self.channel
        if channel is None:
            return
        if self._declare is not None:
            self.step = "queue.declare"
            channel.queue_declare(self._queue, callback=self._consume, **self._declare)
        else:
            self._consume(None)

    def _consume(self, _frame: Any) -> None:
        channel = self.channel
        if channel is None or self.draining or not channel.is_open:
            return
        self.step = "basic.consume"
        self._consumer_tag = channel.basic_consume(
            self._queue,
            scanner_takes_deliveries,
            arguments=self._consumer_arguments or None,
            callback=self._on_consume_ok,
        )

    def _on_consume_ok(self, _frame: Any) -> None:
        self.step = ""
        self._on_ready(self)

    def _on_server_cancel(self, _frame: Any) -> None:
        # The queue was deleted or became unavailable: close the channel (its deliveries go back
        # to the queue); the link subscribes again under the policy.
        if self.draining:
            return
        self.cancelled = True
        log.warning(
            "reliable-amqp: the broker cancelled the consumer of %r (queue deleted or "
            "unavailable); subscribing again",
            self._queue,
        )
        if self.is_open:
            assert self.channel is not None
            self.channel.close()

    def _closed(self, _channel: Channel, reason: Any) -> None:
        self._on_closed(self, reason)

    def delivered(self, batch: list[Delivery]) -> None:
        """A batch of this channel's deliveries arrived (each now held until settled)."""
        self.book.delivered_all(batch)
        if self._careful and any(not d.redelivered for d in batch):
            self._leave_careful()

    def _leave_careful(self) -> None:
        """The redelivered messages are through: subscribe again with the full prefetch (the
        cancel first: on a quorum queue a ``basic.qos`` would otherwise raise the old
        subscription's credit, and its cancel would give back a message charged a delivery)."""
        self._careful = False
        channel = self.channel
        tag = self._consumer_tag
        if channel is None or not channel.is_open or tag is None or self.draining:
            return
        same: Channel = channel

        def current() -> bool:
            return bool(same.is_open) and not self.draining

        def resubscribe(_frame: Any) -> None:
            if current():
                self._consume(None)

        def cancelled(_frame: Any) -> None:
            if current():
                # what the old subscription still holds counts against no prefetch any more
                window = max(1, self._prefetch - self.book.held)
                same.basic_qos(prefetch_count=window, callback=resubscribe)

        self._consumer_tag = None
        channel.basic_cancel(tag, callback=cancelled)

    def send_acks(self, force: bool) -> None:
        """Write what the book says is due (everything finished, with ``force``)."""
        channel = self.channel
        if channel is None or not channel.is_open:
            return
        frames = self.book.take(force)
        if frames:
            self._connection.emit_frames(encode_ack_frames(channel.channel_number, frames))

    def cancel(self) -> None:
        """``basic.cancel``: no new deliveries; settlements still go out."""
        channel = self.channel
        if channel is not None and channel.is_open and self._consumer_tag is not None:
            channel.basic_cancel(self._consumer_tag)
            self._consumer_tag = None

    def drain(self) -> None:
        """Stopping: cancel, ack what finished, give every other delivery back."""
        self.draining = True
        self.cancel()
        channel = self.channel
        if channel is None or not channel.is_open:
            return
        frames = self.book.requeue_rest()
        if frames:
            self._connection.emit_frames(encode_ack_frames(channel.channel_number, frames))
