"""A consumer's settlements: made on any thread, sent as ack frames on the I/O thread.

The handler side calls :meth:`Settlements.add` (cheap: a deque append, a wake-up only when a
batch is due or the settlement is urgent); the I/O thread, woken once however many arrive,
applies them to the channel's :class:`~reliable_amqp._core.acks.AckBook` and writes the frames
it decides (:meth:`Settlements.send`). Settlements of a channel that died are counted as stale
and never sent: the broker gave those messages back already.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from reliable_amqp._core.acks import AckBook, ack_batch
from reliable_amqp._sync._pika import call_threadsafe


class Settlements:
    """Settlements waiting for the I/O thread (see the module docstring)."""

    def __init__(self, prefetch: int, on_wake: Callable[[], None]) -> None:
        #: a batch: how many settlements wake the I/O thread (a tenth of the prefetch)
        self.batch = ack_batch(prefetch)
        self._on_wake = on_wake
        self._queue: deque[tuple[int, int, int]] = deque()  # (generation, tag, kind)
        self._pending = False  # a wake-up is on its way
        self._lock = threading.Lock()
        self._connection: Any = None
        #: send every finished tag at the next wake-up, not only a whole batch
        self.force = False
        #: settlements dropped because their channel had died
        self.stale = 0

    def attach(self, connection: Any) -> None:
        """The connection whose I/O loop wake-ups go to (None between connections)."""
        with self._lock:
            self._connection = connection
            self._pending = False

    def clear(self) -> None:
        """Forget everything (a new run)."""
        self._queue.clear()
        self.force = False

    def add(self, generation: int, tag: int, kind: int, urgent: bool) -> None:
        """A delivery is finished (any thread)."""
        self._queue.append((generation, tag, kind))
        if urgent:
            # a republish was confirmed on another thread, maybe after the handler side went
            # idle (its flush saw nothing): this ack must not wait for a batch
            self.force = True
            self.wake()
        elif len(self._queue) >= self.batch and not self._pending:
            self.wake()

    def flush(self, book: AckBook | None) -> None:
        """Send every ack that is due now (the handler side is idle; any thread)."""
        if self._queue or (book is not None and book.due):
            self.force = True
            self.wake()

    def wake(self) -> None:
        """Have the I/O thread call ``on_wake`` (once for any number of calls meanwhile)."""
        if self._pending:  # read without the lock: a wake-up is on its way already
            return
        with self._lock:
            if self._pending:
                return
            connection = self._connection
            if connection is None:
                return
            self._pending = True
        call_threadsafe(connection.ioloop, self._woken)

    def _woken(self) -> None:
        with self._lock:
            self._pending = False
        self._on_wake()

    def send(self, book: AckBook | None, channel: Any) -> None:
        """Apply what was settled to ``book`` and write the frames due (I/O thread)."""
        queue = self._queue
        force = self.force
        self.force = False
        if book is None:
            while queue:
                queue.popleft()
                self.stale += 1
            return
        self.stale += book.settle_all(queue)
        if channel is None or not channel.is_open:
            return
        _write(channel, book.take(force))

    def requeue_rest(self, book: AckBook | None, channel: Any) -> None:
        """Give back everything ``book`` still holds (I/O thread; stopping)."""
        if book is not None and channel is not None and channel.is_open:
            _write(channel, book.requeue_rest())


def _write(channel: Any, frames: list[tuple[str, int, bool]]) -> None:
    for method, tag, multiple in frames:
        if method == "ack":
            channel.basic_ack(tag, multiple)
        else:
            channel.basic_nack(tag, multiple, requeue=True)
