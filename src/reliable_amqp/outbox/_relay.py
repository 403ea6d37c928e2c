"""OutboxRelay: publishes the outbox's committed rows through a confirming :class:`Publisher`
and deletes each row only once the broker confirmed it.

One thread runs the loop (``run()``): settle what the broker answered (delete confirmed rows in
batches, move refused ones to the failed table), keep the partitions shared with the other
relays, read the next rows of the partitions it owns and publish them, then sleep until a
confirm, a writer's notification or ``poll_interval``. The decisions are in
:mod:`reliable_amqp.outbox._plan`; the SQL in one store per database.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from reliable_amqp._core.errors import ConfigurationError, InvalidMessage, PublishTimeout
from reliable_amqp._core.message import Confirmation, OutgoingMessage
from reliable_amqp._sync.publisher import Publisher
from reliable_amqp.outbox._plan import Ownership, ReadCursor, attempts_of, failure_reason
from reliable_amqp.outbox._rows import PendingRow, UnreadableRow, runs
from reliable_amqp.outbox._schema import DEFAULT_TABLE, PARTITIONS, Tables
from reliable_amqp.outbox._stores import RelayStore, database_errors, open_store
from reliable_amqp.outbox._telemetry import OutboxMetrics, continue_trace

log = logging.getLogger("reliable_amqp.outbox")


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


class _InFlight:
    __slots__ = ("created_at", "part")

    def __init__(self, part: int, created_at: float) -> None:
        self.part = part
        self.created_at = created_at


class OutboxRelay:
    """Publishes an outbox's committed rows, deleting each once the broker confirmed it.

    ``OutboxRelay(db, url, **publisher_options)``: ``db`` a DSN (``postgresql://...`` or
    ``sqlite:///path``), ``url`` the broker's; the remaining keywords are the
    :class:`~reliable_amqp.PublisherOptions` of its publisher (mandatory by default, so that
    "confirmed" means "stored in a queue"). ``run()`` works until ``stop()`` (from any thread,
    or a signal handler); run it in a thread of an application, in a process of its own
    (``reliable-amqp outbox relay``), or from asyncio with ``await asyncio.to_thread(relay.run)``.

    Several relays may work one outbox: they share its partitions (see docs/outbox.md); each row
    is published by one relay at a time, rows of one key in order.
    """

    def __init__(
        self,
        db: str,
        url: str | Sequence[str],
        *,
        table: str = DEFAULT_TABLE,
        batch: int = 1000,
        poll_interval: float = 1.0,
        rescan_interval: float = 1.0,
        rebalance_interval: float = 1.0,
        stop_timeout: float = 30.0,
        long_transaction_warning: float = 30.0,
        name: str | None = None,
        **publisher_options: Any,
    ) -> None:
        for option, value in (
            ("batch", batch),
            ("poll_interval", poll_interval),
            ("rescan_interval", rescan_interval),
            ("rebalance_interval", rebalance_interval),
            ("long_transaction_warning", long_transaction_warning),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigurationError(f"{option}: expected a positive number, got {value!r}")
        if isinstance(stop_timeout, bool) or not isinstance(stop_timeout, int | float):
            raise ConfigurationError(f"stop_timeout: expected a number, got {stop_timeout!r}")
        self.tables = Tables.named(table)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._db = db
        self._store: RelayStore = open_store(db, self.tables, self.name)
        publisher_options.setdefault("max_in_flight", 5000)
        self._publisher = Publisher(url, **publisher_options)
        self._window = self._publisher.options.max_in_flight
        self._batch = int(batch)
        self._poll_interval = float(poll_interval)
        self._rebalance_interval = float(rebalance_interval)
        self._stop_timeout = float(stop_timeout)
        self._long_txn = float(long_transaction_warning)
        self._ownership = Ownership(offset=hash(self.name))
        self._cursor = ReadCursor(rescan_interval)
        self._in_flight: dict[int, _InFlight] = {}
        self._done: collections.deque[tuple[int, Future[Confirmation]]] = collections.deque()
        self._to_delete: list[int] = []
        self._to_fail: list[tuple[int, int, str]] = []
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._running = False
        self._warned: set[tuple[str, int]] = set()
        self._db_down_since: float | None = None
        self._metrics = OutboxMetrics(self.tables.name, publisher_options.get("meter_provider"))
        self._published = self._confirmed = self._failed = self._retried = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self._errors = database_errors()

    # --- the public surface -------------------------------------------------------------------

    def run(self, *, until_empty: bool = False) -> None:
        """Relay until :meth:`stop` (or, with ``until_empty``, until no committed row is pending
        and nothing is in flight). Raises what makes relaying impossible (wrong credentials,
        the broker unreachable once the connect policy is spent, a missing outbox table)."""
        if self._running:
            raise ConfigurationError("run(): this relay is running already")
        self._running = True
        self._stopped.clear()
        try:
            self._publisher.connect()
            self._connect_db()
            self._store.start_wakeups(self._wake)
            self._loop(until_empty)
        finally:
            try:
                self._shutdown()
            finally:
                self._running = False
                self._stopped.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop reading; the loop waits (up to ``stop_timeout``) for the confirms in flight,
        deletes what was confirmed and returns. Safe from any thread and from a signal handler.
        With ``timeout``, wait that long for ``run()`` to return; True once it has."""
        self._stopping.set()
        self._wake.set()
        if timeout is None:
            return not self._running
        return self._stopped.wait(timeout) or not self._running

    def stats(self) -> RelayStats:
        """Counters since the relay started."""
        lat = sorted(self._latencies)
        return RelayStats(
            published=self._published,
            confirmed=self._confirmed,
            failed=self._failed,
            retried=self._retried,
            in_flight=len(self._in_flight),
            partitions=len(self._ownership.owned),
            passes=self._cursor.passes,
            latency_p50_s=lat[len(lat) // 2] if lat else None,
            latency_p99_s=lat[min(len(lat) - 1, (len(lat) * 99) // 100)] if lat else None,
        )

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this relay owns now."""
        return frozenset(self._ownership.owned)

    def __enter__(self) -> OutboxRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(self._stop_timeout + 5)

    # --- the loop -----------------------------------------------------------------------------

    def _loop(self, until_empty: bool) -> None:
        next_rebalance = 0.0
        next_health = 0.0
        while not self._stopping.is_set():
            now = time.monotonic()
            self._settle()
            if not self._store.connected:
                if not self._reconnect_db():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                next_rebalance = 0.0
            try:
                self._write_outcomes()
                if now >= next_rebalance:
                    self._rebalance()
                    next_rebalance = now + self._rebalance_interval
                if now >= next_health:
                    self._health()
                    next_health = now + 5.0
                read = self._fill(now)
                if (
                    until_empty
                    and not read
                    and not self._in_flight
                    and not self._done
                    and not self._to_delete
                    and not self._to_fail
                    and len(self._ownership.owned) == PARTITIONS
                    and not self._store.any_pending()
                ):
                    return
            except self._errors as exc:
                self._database_lost(exc)
                continue
            if not read:
                self._wake.wait(self._poll_interval)
                self._wake.clear()

    def _fill(self, now: float) -> bool:
        """Read and publish while the window has room; whether anything was read."""
        read_any = False
        while not self._stopping.is_set():
            room = self._window - len(self._in_flight)
            if room < min(self._batch, max(1, self._window // 4)):
                return read_any
            parts = self._ownership.readable()
            if parts is not None and not parts:
                return read_any
            after = self._cursor.start(now)
            top = max(self._in_flight) if self._in_flight else 0
            skip = [i for i in self._in_flight if i > after] if after < top else []
            limit = min(self._batch, room)
            rows = self._store.read(after, parts, skip, limit)
            self._cursor.read([r.id for r in rows], limit)
            if not rows:
                return read_any
            read_any = True
            self._publish(rows)
            self._settle()
            self._write_outcomes()
            if len(rows) < limit:
                return read_any
        return read_any

    def _publish(self, rows: list[PendingRow]) -> None:
        good: list[PendingRow] = []
        messages: list[OutgoingMessage] = []
        for row in rows:
            try:
                messages.append(row.message())
                good.append(row)
            except UnreadableRow as exc:
                self._to_fail.append((row.id, 0, f"UnreadableRow: {exc}"))
        publisher = self._publisher
        for run in runs(good, messages):
            for row in run.rows:
                self._in_flight[row.id] = _InFlight(row.part, row.created_at)
            if run.rows[0].traceparent is not None:
                for row, message in zip(run.rows, run.messages, strict=True):
                    self._publish_one(row, message)
                continue
            try:
                futures = publisher.publish_many(
                    run.exchange,
                    run.routing_key,
                    [m.body for m in run.messages],
                    mandatory=run.mandatory,
                    message_ids=[m.message_id for m in run.messages],
                    **run.properties,
                )
            except InvalidMessage:
                # one of them cannot go out through this publisher (its user_id, a header
                # larger than the broker's frame_max): one at a time, to fail only that one
                for row, message in zip(run.rows, run.messages, strict=True):
                    self._publish_one(row, message)
                continue
            except PublishTimeout:
                for row in run.rows:
                    del self._in_flight[row.id]
                self._cursor.restart()
                return
            self._published += len(futures)
            for row, future in zip(run.rows, futures, strict=True):
                future.add_done_callback(partial(self._on_done, row.id))

    def _publish_one(self, row: PendingRow, message: OutgoingMessage) -> None:
        try:
            with continue_trace(row.traceparent, row.tracestate):
                future = self._publisher.publish_message(message)
        except InvalidMessage as exc:
            del self._in_flight[row.id]
            self._to_fail.append((row.id, 0, f"InvalidMessage: {exc}"))
            return
        except PublishTimeout:
            del self._in_flight[row.id]
            self._cursor.restart()
            return
        self._published += 1
        future.add_done_callback(partial(self._on_done, row.id))

    def _on_done(self, row_id: int, future: Future[Confirmation]) -> None:
        # the publisher's I/O thread: hand over, wake the loop, nothing more
        self._done.append((row_id, future))
        self._wake.set()

    def _settle(self) -> None:
        """Take in what the broker answered since the last call."""
        done = self._done
        now = time.time()
        while done:
            row_id, future = done.popleft()
            entry = self._in_flight.pop(row_id, None)
            if entry is None:
                continue
            exc: BaseException | None = None
            try:
                future.result(0)
            except BaseException as error:  # the future's outcome, CancelledError included
                exc = error
            if exc is None:
                self._to_delete.append(row_id)
                latency = now - entry.created_at
                self._latencies.append(latency)
                self._metrics.confirmed(latency)
                continue
            reason = failure_reason(exc)
            if reason is None:
                self._retried += 1
                self._cursor.restart()  # read it again
            else:
                self._to_fail.append((row_id, attempts_of(exc), reason))

    def _write_outcomes(self) -> None:
        if self._to_delete:
            ids = self._to_delete
            self._store.delete(ids)
            self._confirmed += len(ids)
            self._to_delete = []
        if self._to_fail:
            failures = self._to_fail
            self._store.fail(failures)
            self._failed += len(failures)
            self._metrics.failed(len(failures))
            for row_id, attempts, reason in failures[:5]:
                log.warning(
                    "outbox %s: row %d moved to %s after %d attempt(s): %s",
                    self.tables.name,
                    row_id,
                    self.tables.failed,
                    attempts,
                    reason,
                )
            if len(failures) > 5:
                log.warning(
                    "outbox %s: %d more rows moved to %s (reliable-amqp outbox failed lists them)",
                    self.tables.name,
                    len(failures) - 5,
                    self.tables.failed,
                )
            self._to_fail = []

    def _rebalance(self) -> None:
        store, own = self._store, self._ownership
        relays = store.relays()
        own.drain(own.surplus(relays))
        if own.draining:
            busy = {entry.part for entry in self._in_flight.values()}
            free = [p for p in own.draining if p not in busy]
            if free:
                self._write_outcomes()  # confirmed rows deleted before another relay reads them
                store.unlock(free)
                own.released(free)
        wanted = own.wanted(relays)
        room = own.target(relays) - len(own.owned - own.draining)
        if wanted and room > 0:
            got = store.try_lock(wanted, room)
            if got:
                own.acquired(got)
                self._cursor.restart()
                log.debug(
                    "outbox %s: relay %s took %d partitions", self.tables.name, self.name, len(got)
                )

    def _health(self) -> None:
        """Warn once about each long transaction that has written rows nobody can see yet."""
        if 0 not in self._ownership.owned:
            return  # one relay speaks for all: the owner of partition 0
        writers = self._store.open_writers()
        self._metrics.observe_open(writers)
        seen = set()
        for writer in writers:
            key = (writer.session, int(time.time() - writer.age_s))
            seen.add(writer.session)
            if writer.age_s < self._long_txn or any(w[0] == writer.session for w in self._warned):
                continue
            self._warned.add(key)
            log.warning(
                "outbox %s: a transaction open for %.0f s (session %s%s) has written rows no relay "
                "can see until it commits; they are not skipped, and go out once it commits. While "
                "it stays open, VACUUM cannot remove dead rows (reliable-amqp outbox status shows "
                "its age)",
                self.tables.name,
                writer.age_s,
                writer.session,
                f", {writer.application}" if writer.application else "",
            )
        self._warned = {w for w in self._warned if w[0] in seen}

    # --- the database going away --------------------------------------------------------------

    def _connect_db(self) -> None:
        self._store.connect()

    def _database_lost(self, exc: BaseException) -> None:
        if self._db_down_since is None:
            self._db_down_since = time.monotonic()
            log.warning(
                "outbox %s: lost the database (%s: %s); its partitions are free for other relays, "
                "reconnecting (rows confirmed meanwhile are deleted once it is back)",
                self.tables.name,
                type(exc).__name__,
                str(exc).strip().splitlines()[0] if str(exc) else "",
            )
        self._ownership.lost_all()
        self._cursor.restart()
        self._store.drop()

    def _reconnect_db(self) -> bool:
        # Another relay may own our partitions now: publish nothing more of them until what
        # this relay has in flight is settled (no row published by two relays at once).
        if self._in_flight:
            return False
        try:
            self._store.connect()
        except self._errors:
            return False
        if self._db_down_since is not None:
            log.warning(
                "outbox %s: the database is back after %.1f s",
                self.tables.name,
                time.monotonic() - self._db_down_since,
            )
            self._db_down_since = None
        return True

    def _shutdown(self) -> None:
        deadline = time.monotonic() + max(0.0, self._stop_timeout)
        with contextlib.suppress(Exception):  # a publisher that failed for good flushes nothing
            self._publisher.flush(max(0.0, deadline - time.monotonic()))
        self._settle()
        self._write_outcomes_if_connected()
        self._publisher.close(max(0.0, deadline - time.monotonic()))
        self._settle()  # what close() failed stays pending: the next relay publishes it
        self._write_outcomes_if_connected()
        self._store.close()
        self._ownership.lost_all()

    def _write_outcomes_if_connected(self) -> None:
        if not self._store.connected:
            return
        try:  # noqa: SIM105  (suppress() takes no tuple in typeshed)
            self._write_outcomes()
        except self._errors:
            pass  # rows stay pending: published again (same ids) by the next relay
