"""A consumer's health, as a process supervisor or an orchestrator's probe asks for it.

:meth:`Consumer.health` and :meth:`AsyncConsumer.health` build a :class:`ConsumerHealth` from
what the I/O thread and the handler side record anyway (a timestamp per socket read, one per
handler call): nothing is computed per message for it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ConsumerHealth:
    """A snapshot of one consumer (see docs/consumer.md, "Running as a service").

    ``running``: :meth:`run` is in progress. ``connected``: its connection is open (``node`` is
    the ``host:port`` it is open to). ``subscribed``: the broker is delivering to it (cleared
    while it recovers). ``last_delivery_age``: seconds since the last delivery arrived (None
    before the first). ``handler_age``: seconds the longest-running handler has run (None when
    none runs). ``partitions``: the partitions this member of a group holds now, in order
    (``partitions=N`` consumers; None for a consumer of one queue): a member that holds none
    is still healthy (a group with more members than partitions leaves some idle).
    ``healthy``: running, connected, subscribed, and no handler past ``handler_timeout``; an
    idle consumer is healthy (an empty queue is no fault).
    """

    running: bool
    connected: bool
    subscribed: bool
    node: str | None
    last_delivery_age: float | None
    handler_age: float | None
    handler_timeout: float | None
    partitions: tuple[int, ...] | None = None

    @property
    def healthy(self) -> bool:
        """Whether a liveness or readiness probe should pass."""
        stuck = (
            self.handler_age is not None
            and self.handler_timeout is not None
            and self.handler_age > self.handler_timeout
        )
        return self.running and self.connected and self.subscribed and not stuck

    def as_dict(self) -> dict[str, object]:
        """The snapshot, ``healthy`` included, ready for ``json.dumps``."""
        data: dict[str, object] = asdict(self)
        data["healthy"] = self.healthy
        return data


def snapshot(
    *,
    running: bool,
    connected: bool,
    subscribed: bool,
    node: str | None,
    last_delivery: float | None,
    handler_started: float | None,
    handler_timeout: float | None,
    partitions: tuple[int, ...] | None = None,
) -> ConsumerHealth:
    """A :class:`ConsumerHealth` from monotonic timestamps (None where nothing happened)."""
    now = time.monotonic()
    return ConsumerHealth(
        running=running,
        connected=connected,
        subscribed=subscribed,
        node=node,
        last_delivery_age=None if last_delivery is None else round(now - last_delivery, 3),
        handler_age=None if handler_started is None else round(now - handler_started, 3),
        handler_timeout=handler_timeout,
        partitions=partitions,
    )
