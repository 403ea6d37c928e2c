"""Connection-lifecycle bookkeeping both publishers share: what was lost, since when, and the
events that tell a user about it (connected, lost, recovered with its downtime, ...)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from reliable_amqp._core.stats import Counters, EventKind, PublisherEvent

log = logging.getLogger("reliable_amqp")


class Lifecycle:
    """Reports events to the ``on_event`` hook and measures how long each outage lasted."""

    def __init__(
        self,
        on_event: Callable[[PublisherEvent], None] | None,
        counters: Counters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hook = on_event
        #: told of every event before the hook (telemetry: blocked time); must not raise
        self.listener: Callable[[PublisherEvent], None] | None = None
        self._counters = counters
        self._clock = clock
        self._ever_opened = False
        #: what was lost ("connection" or "channel") and since when, until recovered
        self._lost: tuple[str, float] | None = None

    def emit(
        self,
        kind: EventKind,
        detail: str,
        downtime: float | None = None,
        error: BaseException | None = None,
        *,
        attempt: int | None = None,
        delay: float | None = None,
    ) -> None:
        """Call the hook, if any; a hook that raises is logged, not propagated."""
        if self._hook is None and self.listener is None:
            return
        event = PublisherEvent(kind, detail, self._clock(), downtime, error, attempt, delay)
        if self.listener is not None:
            self.listener(event)
        if self._hook is None:
            return
        try:
            self._hook(event)
        except Exception:
            log.exception("reliable-amqp: on_event hook raised (ignored)")

    def lost(self, what: str, kind: EventKind, detail: str) -> None:
        """The connection or channel went away (a lost connection takes over from a lost
        channel, keeping the earlier start time)."""
        if self._lost is None or what == "connection":
            since = self._lost[1] if self._lost is not None else self._clock()
            self._lost = (what, since)
        self.emit(kind, detail)

    def retrying(
        self,
        where: str,
        then: str,
        loss: BaseException,
        attempt: int,
        delay: float,
        *,
        established: bool,
    ) -> None:
        """A connection to ``where`` failed (``established``: it was open, and is lost) and
        attempt number ``attempt`` follows, to ``then``, in ``delay`` s: one WARNING line, and
        a RETRYING event. A connection that never opened is not called lost."""
        what = f"connection to {where} lost" if established else f"cannot connect to {where}"
        to = f" to {then}" if then != where else ""
        detail = f"{what}: {loss}; attempt {attempt}{to} in {delay:.2f} s"
        log.warning("reliable-amqp: %s", detail)
        self.emit(EventKind.RETRYING, detail, error=loss, attempt=attempt, delay=delay)

    def gave_up(self, error: BaseException) -> None:
        """Recovery is over with ``error``: a RECOVERY_FAILED event. Logged at DEBUG only: the
        error reaches the caller (``connect()`` raises it, every pending message fails with it
        as cause), who reports it; the library does not say it twice."""
        log.debug("reliable-amqp: %s", error)
        self.emit(EventKind.RECOVERY_FAILED, str(error), error=error)

    def opened(self) -> None:
        """Confirm mode is on: report the first connection, or the recovery and its downtime."""
        if not self._ever_opened:
            self._ever_opened = True
            self.emit(EventKind.CONNECTED, "connected; confirm mode on")
        elif self._lost is not None:
            what, since = self._lost
            if what == "connection":
                self._counters.recoveries += 1
            downtime = self._clock() - since
            self.emit(EventKind.RECOVERED, f"{what} recovered after {downtime:.3f} s", downtime)
        self._lost = None
