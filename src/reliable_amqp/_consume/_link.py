"""What the consumer's handler side needs of the I/O that feeds it: one interface, several I/Os.

:class:`~reliable_amqp._consume._io.ConsumerIO` (one queue, one pika connection on a thread of
its own) is one; a partitioned consumer's group of them is another. :class:`ConsumerCore`,
:class:`~reliable_amqp._consume._dispatch.Dispatch` and the redeliverer talk to a
:class:`ConsumerLink` only, so the handler side is the same whatever moves the bytes.

Deliveries reach the handler side through the ``on_deliveries`` callable the link was built
with (in batches, on the link's own thread); each carries the ``generation`` of the channel it
came on, and :meth:`ConsumerLink.settle` takes that generation back with the delivery tag.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol

from reliable_amqp._core.errors import ReliableAmqpError


class ConsumerLink(Protocol):
    """The I/O under a consumer, as its handler side sees it (any thread unless said)."""

    #: the queue consumed (a partitioned consumer's name)
    queue: str
    prefetch: int
    #: set when the I/O ended for good (stop, or ``fatal``)
    ended: threading.Event
    #: set while a subscription is live
    consuming: threading.Event

    @property
    def fatal(self) -> ReliableAmqpError | None:
        """The error that ended the I/O (a spent connect policy, a refusal), if any."""

    @property
    def node(self) -> str | None:
        """``host:port`` of the connection (None while there is none)."""

    @property
    def server_properties(self) -> Mapping[str, Any] | None:
        """The connected broker's ``connection.start`` properties."""

    @property
    def last_delivery(self) -> float | None:
        """Monotonic time of the last read that brought deliveries."""

    @property
    def recoveries(self) -> int:
        """Subscriptions got back after a loss (a new connection or channel)."""

    @property
    def stale_settlements(self) -> int:
        """Settlements dropped because their channel had died (the broker requeued those)."""

    @property
    def connected(self) -> bool:
        """Whether a connection is open."""

    @property
    def unacked(self) -> int:
        """Deliveries the broker counts as unacknowledged on the open channel(s) now."""

    def is_live(self, generation: int) -> bool:
        """Whether a delivery of ``generation`` may start (its channel is open: the broker has
        not given it back to the queue). Called once per delivery, as its handler is about to
        start: False drops the delivery unsettled (a partition group counts it as left for
        the queue)."""

    def start(self) -> None:
        """Start consuming (again, after a run that ended)."""

    def settle(self, generation: int, tag: int, kind: int = ..., urgent: bool = False) -> None:
        """A delivery is finished (``ACK``) or goes back to the queue (``REQUEUE``)."""

    def flush(self) -> None:
        """Send every settlement that is due (the handler side is idle)."""

    def cancel(self) -> None:
        """Stop new deliveries; settlements still go out."""

    def drain(self, timeout: float) -> bool:
        """Cancel, ack what was settled, requeue the rest; True once the frames are out."""

    def stop(self, timeout: float | None = None) -> None:
        """Close (what is unacked goes back to the queue) and end the I/O."""
