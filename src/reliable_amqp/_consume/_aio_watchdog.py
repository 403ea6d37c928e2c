"""A watchdog thread that keeps a consumer's heartbeats going while its event loop is blocked.

The async consumer's connection lives on the event loop (:mod:`reliable_amqp._consume._aio_io`),
so pika's heartbeat timers run only when the loop does. An ``async def`` handler that awaits
costs them nothing; one that *blocks* the loop (``time.sleep``, a blocking database driver, a
long computation) stops them, and after two missed heartbeats the broker would close the
connection: the handler's ack would then be dropped and the message delivered again. This
thread notices, says so, and writes the heartbeat frames in the loop's place.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from reliable_amqp._compat.pika import LoopScanningConnection
from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.liveness import LinkWatch

#: what the watchdog calls (on the loop) when a connection went two heartbeats without a byte
OnLost = Callable[[LoopScanningConnection, ReliableAmqpError], None]

log = logging.getLogger("reliable_amqp")


class Watchdog:
    """Keeps a connection's heartbeats going while the event loop is blocked.

    The loop stamps :attr:`pulse` on a timer every quarter heartbeat; this thread looks as
    often. When the stamp is older than half a heartbeat, the loop is blocked (a handler's
    blocking call): it says so once per stall at WARNING and writes a heartbeat frame itself
    (:meth:`LoopScanningConnection.heartbeat_from_thread`); when the loop runs again, the loop
    says for how long it was blocked.
    """

    def __init__(self, queue: str) -> None:
        self._queue = queue
        self._connection: LoopScanningConnection | None = None
        self._period = 0.0
        self.pulse = time.monotonic()
        self._stalled_since: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (it ends with :meth:`stop`)."""
        self._thread = threading.Thread(
            target=self._watch, name="reliable-amqp-consume-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """End the thread (the loop's timer ends with it)."""
        self._done.set()
        self._connection = None

    def watch(self, connection: LoopScanningConnection, heartbeat: int, on_lost: OnLost) -> None:
        """A connection opened with ``heartbeat`` (0: none, nothing to keep alive).

        Also, on a loop timer, the publishers' liveness rule
        (:class:`~reliable_amqp._core.liveness.LinkWatch`): two heartbeats without a byte
        received is a lost link (a frozen node closes nothing): ``on_lost`` is called.
        """
        self._connection = connection if heartbeat else None
        self._period = heartbeat / 4
        if heartbeat:
            self._beat(connection)
        watch = LinkWatch()
        watch.reset(time.monotonic(), heartbeat)
        watch.check(connection.bytes_received, time.monotonic())
        loop = asyncio.get_running_loop()

        def check() -> None:
            if connection is not self._connection or not connection.is_open:
                return
            now = time.monotonic()
            loss = watch.check(connection.bytes_received, now)
            if loss is not None:
                on_lost(connection, loss)
                return
            due = watch.check_at
            if due is not None:
                loop.call_later(max(0.0, due - now), check)

        due = watch.check_at
        if due is not None:
            loop.call_later(max(0.0, due - time.monotonic()), check)

    def _beat(self, connection: LoopScanningConnection) -> None:
        now = time.monotonic()
        if self._stalled_since is not None:
            log.warning(
                "reliable-amqp: the event loop of the consumer of %r ran again after %.1f s "
                "blocked",
                self._queue,
                now - self.pulse,
            )
            self._stalled_since = None
        self.pulse = now
        if connection is self._connection and connection.is_open and not self._done.is_set():
            asyncio.get_running_loop().call_later(self._period, self._beat, connection)

    def _watch(self) -> None:
        while not self._done.wait(self._period or 0.5):
            connection = self._connection
            period = self._period
            if connection is None or not period or not connection.is_open:
                continue
            stalled = time.monotonic() - self.pulse
            if stalled < 2 * period:  # half a heartbeat
                continue
            written = connection.heartbeat_from_thread()
            if self._stalled_since is None:
                self._stalled_since = self.pulse
                log.warning(
                    "reliable-amqp: the event loop of the consumer of %r has not run for %.1f s "
                    "(a blocking call in a handler?): deliveries, acks and the other handlers "
                    "wait for it; %s",
                    self._queue,
                    stalled,
                    "this consumer's watchdog thread sends the connection's heartbeats meanwhile"
                    if written
                    else "heartbeats cannot be written from another thread on this connection "
                    "(TLS, or the socket's buffer full): after two missed heartbeats the broker "
                    "closes it, and the consumer reconnects once the loop runs again (the "
                    "running handler's message comes back, redelivered)",
                )
