"""The relay's loop, written once for both relays: a generator that yields the operations it
needs (a database call, a publish, a wait) and is sent their results.

:class:`~reliable_amqp.outbox.OutboxRelay` drives it from a thread with a ``Publisher``;
:class:`~reliable_amqp.outbox.AsyncOutboxRelay` from a task with an ``AsyncPublisher``. Neither
decides anything: what to read, when a partition changes hands, what an outcome means for a
row, are here and in :mod:`reliable_amqp.outbox._plan`. A database error is thrown back into
the generator, where the loop treats it as the database going away.

Each pass of the loop: settle what the broker answered (confirmed rows deleted in batches,
refused ones moved to the failed table), keep the partitions shared with the other relays, read
the next rows of the partitions owned and publish them, then wait for a confirm, a writer's
wake-up or ``poll_interval``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any

from reliable_amqp._core.errors import InvalidMessage, PublishTimeout
from reliable_amqp._core.message import OutgoingMessage
from reliable_amqp.outbox._plan import Ownership, ReadCursor, attempts_of, failure_reason
from reliable_amqp.outbox._rows import PendingRow, Run, UnreadableRow, runs
from reliable_amqp.outbox._schema import PARTITIONS, Tables
from reliable_amqp.outbox._status import OpenWriter
from reliable_amqp.outbox._telemetry import OutboxMetrics

log = logging.getLogger("reliable_amqp.outbox")

#: how often the owner of partition 0 looks for long transactions and the backlog
HEALTH_INTERVAL = 5.0
#: the backlog metric counts pending rows up to this many (40 ms on PostgreSQL; 1,000,000 took
#: 350-470 ms, every 5 s, on the loop's thread)
BACKLOG_CAP = 100_000


# --- the operations the loop asks its driver for --------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreCall:
    """Call the store's method ``name`` with ``args``; its result is sent back."""

    name: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class PublishRun:
    """``publish_many()`` of a run of rows; the list of futures is sent back."""

    run: Run


@dataclass(frozen=True, slots=True)
class PublishOne:
    """``publish_message()`` of one row's message, inside the writer's trace context; its
    future is sent back."""

    row: PendingRow
    message: OutgoingMessage


@dataclass(frozen=True, slots=True)
class Wait:
    """Sleep until woken (a confirm, a writer's commit, ``stop()``) or ``timeout`` passes."""

    timeout: float


@dataclass(frozen=True, slots=True)
class PublisherCall:
    """Call the publisher's ``connect``, ``flush`` or ``close``."""

    name: str
    args: tuple[Any, ...] = ()


Op = StoreCall | PublishRun | PublishOne | Wait | PublisherCall
Steps = Generator[Op, Any, None]


@dataclass(frozen=True)
class RelayStats:
    """A relay's counters since it started."""

    published: int
    confirmed: int
    failed: int
    retried: int
    in_flight: int
    partitions: int
    passes: int
    #: commit-to-confirm latency of confirmed rows, seconds (None until one was confirmed)
    latency_p50_s: float | None
    latency_p99_s: float | None


class _Notified:
    """The wake-up a store's listener gets: notes that a writer committed, wakes the loop
    (``set()`` from any thread)."""

    __slots__ = ("is_set", "wake")

    def __init__(self, wake: Any) -> None:
        self.wake = wake
        self.is_set = True  # read at start

    def set(self) -> None:
        self.is_set = True
        self.wake.set()


class _InFlight:
    __slots__ = ("created_at", "part")

    def __init__(self, part: int, created_at: float) -> None:
        self.part = part
        self.created_at = created_at


class RelayLoop:
    """The state of one relay and its loop (:meth:`steps`), shared by both drivers."""

    def __init__(
        self,
        tables: Tables,
        name: str,
        *,
        window: int,
        batch: int,
        poll_interval: float,
        rescan_interval: float,
        rebalance_interval: float,
        long_transaction_warning: float,
        errors: tuple[type[BaseException], ...],
        metrics: OutboxMetrics,
        wake: Any,
        exception_of: Callable[[Any], BaseException | None],
    ) -> None:
        self.tables = tables
        #: what wakes the driver's Wait (``set()``: thread-safe): the store's listener sets it
        self.wake = wake
        #: the exception a finished future of the driver's publisher holds, or None
        self.exception_of = exception_of
        #: what the store's listener sets when a writer committed (it wakes the loop too)
        self.notified = _Notified(wake)
        #: rows may be waiting beyond the last read (see _read_due)
        self.more = True
        self.last_read = 0.0
        self.name = name
        self.window = window
        self.batch = batch
        self.poll_interval = poll_interval
        self.rebalance_interval = rebalance_interval
        self.long_txn = long_transaction_warning
        self.errors = errors
        self.metrics = metrics
        self.ownership = Ownership(offset=hash(name))
        self.cursor = ReadCursor(rescan_interval)
        self.in_flight: dict[int, _InFlight] = {}
        #: (row id, future) of messages the broker answered: filled by the futures'
        #: callbacks (on the publisher's thread or loop), emptied by the loop
        self.done: collections.deque[tuple[int, Any]] = collections.deque()
        self.to_delete: list[int] = []
        self.to_fail: list[tuple[int, int, str]] = []
        self.stopping = False
        self.connected = False
        self._warned: set[str] = set()
        self._db_down_since: float | None = None
        self.published = self.confirmed = self.failed = self.retried = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=10_000)

    # --- what the drivers call ----------------------------------------------------------------

    def on_done(self, row_id: int, future: Any) -> None:
        """A future's callback (the publisher's thread or loop): hand over, wake the loop."""
        self.done.append((row_id, future))
        self.wake.set()

    def stats(self) -> RelayStats:
        lat = sorted(self._latencies)
        return RelayStats(
            published=self.published,
            confirmed=self.confirmed,
            failed=self.failed,
            retried=self.retried,
            in_flight=len(self.in_flight),
            partitions=len(self.ownership.owned),
            passes=self.cursor.passes,
            latency_p50_s=lat[len(lat) // 2] if lat else None,
            latency_p99_s=lat[min(len(lat) - 1, (len(lat) * 99) // 100)] if lat else None,
        )

    # --- the loop -----------------------------------------------------------------------------

    def steps(self, until_empty: bool) -> Steps:
        """Connect, relay until stopped (or empty), then settle what is in flight."""
        yield PublisherCall("connect")
        yield StoreCall("connect")
        self.connected = True
        yield StoreCall("start_wakeups", (self.notified,))
        next_rebalance = next_health = 0.0
        while not self.stopping:
            now = time.monotonic()
            self._settle()
            if not self.connected:
                if not (yield from self._reconnect()):
                    yield Wait(0.5)
                    continue
                next_rebalance = 0.0
            try:
                yield from self._write_outcomes()
                if now >= next_rebalance:
                    yield from self._rebalance()
                    next_rebalance = now + self.rebalance_interval
                if now >= next_health:
                    yield from self._health()
                    next_health = now + HEALTH_INTERVAL
                read = (yield from self._fill(now)) if self._read_due(now) else False
                if (
                    until_empty
                    and not read
                    and self._idle()
                    and not (yield StoreCall("any_pending"))
                ):
                    return
            except self.errors as exc:
                yield from self._database_lost(exc)
                continue
            if not read:
                yield Wait(self.poll_interval)

    def shutdown(self, timeout: float) -> Steps:
        """Wait (up to ``timeout``) for what is in flight, delete what was confirmed, close."""
        deadline = time.monotonic() + max(0.0, timeout)
        with contextlib.suppress(Exception):  # a publisher that failed for good flushes nothing
            yield PublisherCall("flush", (max(0.0, deadline - time.monotonic()),))
        self._settle()
        yield from self._write_outcomes_if_connected()
        yield PublisherCall("close", (max(0.0, deadline - time.monotonic()),))
        self._settle()  # what close() failed stays pending: the next relay publishes it
        yield from self._write_outcomes_if_connected()
        yield StoreCall("close")
        self.connected = False
        self.ownership.lost_all()

    def _idle(self) -> bool:
        return (
            not self.in_flight
            and not self.done
            and not self.to_delete
            and not self.to_fail
            and len(self.ownership.owned) == PARTITIONS
        )

    def _restart(self) -> None:
        """A new pass at the next read, and a read due at once."""
        self.cursor.restart()
        self.more = True

    def _read_due(self, now: float) -> bool:
        """Whether to read now: a writer's wake-up came, rows may be left from the last read
        (a full batch, a window that was full, a pass restarted), or ``poll_interval`` passed.
        An idle relay woken by a confirm does not read the table for nothing."""
        return self.notified.is_set or self.more or now - self.last_read >= self.poll_interval

    def _fill(self, now: float) -> Generator[Op, Any, bool]:
        """Read and publish while the window has room; whether anything was read."""
        read_any = False
        self.notified.is_set = False  # what is committed from now on wakes another read
        self.last_read = now
        while not self.stopping:
            room = self.window - len(self.in_flight)
            if room < min(self.batch, max(1, self.window // 4)):
                self.more = True  # read again once confirms free room
                return read_any
            parts = self.ownership.readable()
            if parts is not None and not parts:
                return read_any
            after = self.cursor.start(now)
            top = max(self.in_flight) if self.in_flight else 0
            skip = [i for i in self.in_flight if i > after] if after < top else []
            limit = min(self.batch, room)
            rows: list[PendingRow] = yield StoreCall("read", (after, parts, skip, limit))
            self.cursor.read([r.id for r in rows], limit)
            self.more = len(rows) >= limit
            if not rows:
                return read_any
            read_any = True
            yield from self._publish(rows)
            self._settle()
            yield from self._write_outcomes()
            if len(rows) < limit:
                return read_any
        return read_any

    def _publish(self, rows: list[PendingRow]) -> Steps:
        good: list[PendingRow] = []
        messages: list[OutgoingMessage] = []
        for row in rows:
            try:
                messages.append(row.message())
                good.append(row)
            except UnreadableRow as exc:
                self.to_fail.append((row.id, 0, f"UnreadableRow: {exc}"))
        for run in runs(good, messages):
            for row in run.rows:
                self.in_flight[row.id] = _InFlight(row.part, row.created_at)
            if run.rows[0].traceparent is not None:
                for row, message in zip(run.rows, run.messages, strict=True):
                    yield from self._publish_one(row, message)
                continue
            try:
                futures = yield PublishRun(run)
            except InvalidMessage:
                # one of them cannot go out through this publisher (its user_id, a header
                # larger than the broker's frame_max): one at a time, to fail only that one
                for row, message in zip(run.rows, run.messages, strict=True):
                    yield from self._publish_one(row, message)
                continue
            except PublishTimeout:
                for row in run.rows:
                    del self.in_flight[row.id]
                self._restart()
                return
            self.published += len(futures)
            on_done = self.on_done
            for row, future in zip(run.rows, futures, strict=True):
                future.add_done_callback(partial(on_done, row.id))

    def _publish_one(self, row: PendingRow, message: OutgoingMessage) -> Steps:
        try:
            future = yield PublishOne(row, message)
        except InvalidMessage as exc:
            del self.in_flight[row.id]
            self.to_fail.append((row.id, 0, f"InvalidMessage: {exc}"))
            return
        except PublishTimeout:
            del self.in_flight[row.id]
            self._restart()
            return
        self.published += 1
        future.add_done_callback(partial(self.on_done, row.id))

    def _settle(self) -> None:
        """Take in what the broker answered since the last call."""
        done = self.done
        now = time.time()
        while done:
            row_id, future = done.popleft()
            entry = self.in_flight.pop(row_id, None)
            if entry is None:
                continue
            exc = self.exception_of(future)
            if exc is None:
                self.to_delete.append(row_id)
                latency = now - entry.created_at
                self._latencies.append(latency)
                self.metrics.confirmed(latency)
                continue
            reason = failure_reason(exc)
            if reason is None:
                self.retried += 1
                self._restart()  # still pending: read it again
            else:
                self.to_fail.append((row_id, attempts_of(exc), reason))

    def _write_outcomes(self) -> Steps:
        if self.to_delete:
            ids = self.to_delete
            yield StoreCall("delete", (ids,))
            self.confirmed += len(ids)
            self.to_delete = []
        if self.to_fail:
            failures = self.to_fail
            yield StoreCall("fail", (failures,))
            self.failed += len(failures)
            self.metrics.failed(len(failures))
            for row_id, attempts, reason in failures[:5]:
                log.warning(
                    "outbox %s: row %d moved to %s after %d attempt(s): %s",
                    self.tables.name, row_id, self.tables.failed, attempts, reason,
                )  # fmt: skip
            if len(failures) > 5:
                log.warning(
                    "outbox %s: %d more rows moved to %s (reliable-amqp outbox failed lists them)",
                    self.tables.name, len(failures) - 5, self.tables.failed,
                )  # fmt: skip
            self.to_fail = []

    def _write_outcomes_if_connected(self) -> Steps:
        if not self.connected:
            return
        # rows not deleted stay pending: published again (same ids) by the next relay
        with contextlib.suppress(*self.errors):
            yield from self._write_outcomes()

    def _rebalance(self) -> Steps:
        own = self.ownership
        relays: int = yield StoreCall("relays")
        own.drain(own.surplus(relays))
        if own.draining:
            busy = {entry.part for entry in self.in_flight.values()}
            free = [p for p in own.draining if p not in busy]
            if free:
                # confirmed rows are deleted before another relay may read them
                yield from self._write_outcomes()
                yield StoreCall("unlock", (free,))
                own.released(free)
        wanted = own.wanted(relays)
        room = own.target(relays) - len(own.owned - own.draining)
        if wanted and room > 0:
            got: list[int] = yield StoreCall("try_lock", (wanted, room))
            if got:
                own.acquired(got)
                self._restart()
                log.debug(
                    "outbox %s: relay %s took %d partitions", self.tables.name, self.name, len(got)
                )

    def _health(self) -> Steps:
        """Warn once about each long transaction that has written rows nobody can see yet."""
        if 0 not in self.ownership.owned:
            return  # one relay speaks for all: the owner of partition 0
        writers: list[OpenWriter] = yield StoreCall("open_writers")
        if self.metrics.enabled:  # a count costs the database: only when someone reads it
            pending, oldest = yield StoreCall("backlog", (BACKLOG_CAP,))
            ages = [w.age_s for w in writers]
            if oldest is not None:
                ages.append(max(0.0, time.time() - oldest))
            self.metrics.observe(pending, max(ages) if ages else 0.0, writers)
        seen = {w.session for w in writers}
        for writer in writers:
            if writer.age_s < self.long_txn or writer.session in self._warned:
                continue
            self._warned.add(writer.session)
            log.warning(
                "outbox %s: a transaction open for %.0f s (session %s%s) has written rows no "
                "relay can see until it commits; they are not skipped, and go out once it "
                "commits. While it stays open, VACUUM cannot remove dead rows (reliable-amqp "
                "outbox status shows its age)",
                self.tables.name, writer.age_s, writer.session,
                f", {writer.application}" if writer.application else "",
            )  # fmt: skip
        self._warned &= seen

    def _database_lost(self, exc: BaseException) -> Steps:
        if self._db_down_since is None:
            self._db_down_since = time.monotonic()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            log.warning(
                "outbox %s: lost the database (%s: %s); its partitions are free for other "
                "relays, reconnecting (rows confirmed meanwhile are deleted once it is back)",
                self.tables.name, type(exc).__name__, first,
            )  # fmt: skip
        self.ownership.lost_all()
        self._restart()
        self.connected = False
        yield StoreCall("drop")

    def _reconnect(self) -> Generator[Op, Any, bool]:
        # Another relay may own our partitions now: publish nothing more of them until what
        # this relay has in flight is settled (no row published by two relays at once).
        if self.in_flight:
            return False
        try:
            yield StoreCall("connect")
        except self.errors:
            return False
        self.connected = True
        if self._db_down_since is not None:
            log.warning(
                "outbox %s: the database is back after %.1f s",
                self.tables.name, time.monotonic() - self._db_down_since,
            )  # fmt: skip
            self._db_down_since = None
        return True


def concurrent_exception(future: Any) -> BaseException | None:
    """A finished ``concurrent.futures.Future``'s exception (one call: it is done)."""
    try:
        exc: BaseException | None = future.exception(0)
    except concurrent.futures.CancelledError as cancelled:
        return cancelled
    return exc


def asyncio_exception(future: Any) -> BaseException | None:
    """A finished asyncio future's exception (CancelledError when it was cancelled)."""
    if future.cancelled():
        return asyncio.CancelledError()
    exc: BaseException | None = future.exception()
    return exc
