"""Is the link to the broker alive? One rule for the publishers and the consumer (no I/O).

A broker sends heartbeats, so more than two heartbeat intervals without a byte means the link is
dead, although no socket error says so: a frozen node (SIGSTOP, a long GC pause, a partition that
drops packets) closes nothing. Checked every half heartbeat, the loss is reported 2 to 3
heartbeats after the last byte (pika alone waits 2 x (heartbeat + 5) s, aiormq
3 x (heartbeat + 1) s).
"""

from __future__ import annotations

from reliable_amqp._core.errors import AmqpConnectionError

__all__ = ["LinkWatch"]


class LinkWatch:
    """What the broker sent on one connection, and when to look again."""

    __slots__ = ("_last", "_since", "check_at", "heartbeat")

    def __init__(self) -> None:
        #: negotiated on the current connection (0: no checks)
        self.heartbeat = 0
        #: when :meth:`check` next has something to say (None: no checks pending)
        self.check_at: float | None = None
        # anything that changes whenever the broker sends something, and when it last changed
        self._last: float = -1
        self._since = 0.0

    def reset(self, now: float = 0.0, heartbeat: int | None = None) -> None:
        """Forget what was seen (a new connection, or none); ``heartbeat`` when negotiated."""
        if heartbeat is not None:
            self.heartbeat = max(0, heartbeat)
        self._last = -1
        self._since = now
        self.check_at = None

    def check(self, received: float, now: float) -> AmqpConnectionError | None:
        """``received`` is pika's byte count or the time aiormq read its last frame; an error
        once nothing changed for more than two heartbeats (checks stop then)."""
        heartbeat = self.heartbeat
        if not heartbeat:
            return None
        if received != self._last:
            self._last, self._since = received, now
            self.check_at = now + heartbeat / 2
            return None
        silent = now - self._since
        if silent <= 2 * heartbeat:
            self.check_at = now + heartbeat / 2
            return None
        self.reset(now)
        return AmqpConnectionError(
            f"no data from the broker for {silent:.1f} s (heartbeat {heartbeat} s)"
        )
