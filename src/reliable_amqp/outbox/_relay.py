"""OutboxRelay and AsyncOutboxRelay: publish the outbox's committed rows through a confirming
publisher, deleting each row only once the broker confirmed it.

Both drive the one loop of :mod:`reliable_amqp.outbox._loop` and differ only in how they wait:
``OutboxRelay`` runs it on the thread that calls ``run()``, with a ``Publisher``;
``AsyncOutboxRelay`` runs it as a task of the caller's event loop, with an ``AsyncPublisher``,
its database calls made in one worker thread of its own (the stores are the sync ones).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from reliable_amqp._compat.waits import wait_set
from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._sync._events import SignalSafeEvent
from reliable_amqp._sync.publisher import Publisher
from reliable_amqp.outbox._loop import (
    Op,
    PublishOne,
    PublishRun,
    RelayLoop,
    RelayStats,
    Steps,
    StoreCall,
    Wait,
    asyncio_exception,
    concurrent_exception,
)
from reliable_amqp.outbox._schema import DEFAULT_TABLE, Tables
from reliable_amqp.outbox._stores import RelayStore, database_errors, open_store
from reliable_amqp.outbox._telemetry import OutboxMetrics, continue_trace

__all__ = ["AsyncOutboxRelay", "OutboxRelay"]

#: A relay's in-flight window (its publisher's ``max_in_flight``) unless given. It bounds the
#: duplicates a relay killed -9 leaves (rows published, maybe stored by the broker, not yet
#: deleted: the next relay publishes them again), and a smaller one costs drain speed: see
#: docs/outbox.md, "Duplicates after a crash".
DEFAULT_RELAY_WINDOW = 2000


class _Config:
    """The options both relays take, checked once."""

    def __init__(
        self,
        db: str,
        *,
        table: str,
        batch: int,
        poll_interval: float,
        rescan_interval: float,
        rebalance_interval: float,
        stop_timeout: float,
        long_transaction_warning: float,
        name: str | None,
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
        self.store: RelayStore = open_store(db, self.tables, self.name)
        self.batch = int(batch)
        self.poll_interval = float(poll_interval)
        self.rescan_interval = float(rescan_interval)
        self.rebalance_interval = float(rebalance_interval)
        self.stop_timeout = float(stop_timeout)
        self.long_transaction_warning = float(long_transaction_warning)

    def loop(
        self,
        window: int,
        meter_provider: Any,
        wake: Any,
        exception_of: Callable[[Any], BaseException | None],
    ) -> RelayLoop:
        return RelayLoop(
            self.tables,
            self.name,
            window=window,
            batch=self.batch,
            poll_interval=self.poll_interval,
            rescan_interval=self.rescan_interval,
            rebalance_interval=self.rebalance_interval,
            long_transaction_warning=self.long_transaction_warning,
            errors=database_errors(),
            metrics=OutboxMetrics(self.tables.name, meter_provider),
            wake=wake,
            exception_of=exception_of,
        )


def _publish_run(publisher: Any, op: PublishRun) -> Any:
    run = op.run
    return publisher.publish_many(
        run.exchange,
        run.routing_key,
        [m.body for m in run.messages],
        mandatory=run.mandatory,
        message_ids=[m.message_id for m in run.messages],
        **run.properties,
    )


class OutboxRelay:
    """Publishes an outbox's committed rows, deleting each once the broker confirmed it.

    ``OutboxRelay(db, url, **publisher_options)``: ``db`` a DSN (``postgresql://...``,
    ``mysql://...`` or ``sqlite:///path``), ``url`` the broker's; the remaining keywords are the
    :class:`~reliable_amqp.PublisherOptions` of its publisher (mandatory by default, so that
    "confirmed" means "stored in a queue"; ``max_in_flight`` 2,000, which bounds the duplicates a
    relay killed -9 leaves). ``run()`` works until ``stop()`` (from any thread, or a signal
    handler); run it in a thread of an application or in a process of its own
    (``reliable-amqp outbox relay``). A relay runs once.

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
        config = _Config(
            db, table=table, batch=batch, poll_interval=poll_interval,
            rescan_interval=rescan_interval, rebalance_interval=rebalance_interval,
            stop_timeout=stop_timeout, long_transaction_warning=long_transaction_warning,
            name=name,
        )  # fmt: skip
        publisher_options.setdefault("max_in_flight", DEFAULT_RELAY_WINDOW)
        self._config = config
        self._publisher = Publisher(url, **publisher_options)
        self._wake = SignalSafeEvent()  # set by stop(), which a signal handler may call
        self._loop = config.loop(
            self._publisher.options.max_in_flight,
            publisher_options.get("meter_provider"),
            self._wake,
            concurrent_exception,
        )
        self._running = False
        self._stopped = threading.Event()

    @property
    def name(self) -> str:
        """This relay's name (``outbox status`` shows it)."""
        return self._config.name

    @property
    def tables(self) -> Tables:
        """The outbox's tables."""
        return self._config.tables

    def run(self, *, until_empty: bool = False) -> None:
        """Relay until :meth:`stop` (or, with ``until_empty``, until no committed row is pending
        and nothing is in flight). Raises what makes relaying impossible (wrong credentials,
        the broker unreachable once the connect policy is spent, a missing outbox table)."""
        if self._running or self._stopped.is_set():
            raise ConfigurationError("run(): a relay runs once")
        self._running = True
        try:
            self._drive(self._loop.steps(until_empty))
        finally:
            try:
                self._drive(self._loop.shutdown(self._config.stop_timeout))
            finally:
                self._running = False
                self._stopped.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop reading; ``run()`` waits (up to ``stop_timeout``) for the confirms in flight,
        deletes what was confirmed and returns. Safe from any thread and from a signal handler.
        With ``timeout``, wait that long for ``run()`` to return; True once it has."""
        self._loop.stopping = True
        self._wake.set()
        if timeout is None:
            return not self._running
        return self._stopped.wait(timeout) or not self._running

    def stats(self) -> RelayStats:
        """Counters since the relay started."""
        return self._loop.stats()

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this relay owns now."""
        return frozenset(self._loop.ownership.owned)

    def _drive(self, steps: Steps) -> None:
        result: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.throw(error) if error is not None else steps.send(result)
            except StopIteration:
                return
            result = error = None
            try:
                result = self._do(op)
            except Exception as exc:  # thrown into the loop, which knows what it means
                error = exc

    def _do(self, op: Op) -> Any:
        if isinstance(op, StoreCall):
            return getattr(self._config.store, op.name)(*op.args)
        if isinstance(op, PublishRun):
            return _publish_run(self._publisher, op)
        if isinstance(op, PublishOne):
            with continue_trace(op.row.traceparent, op.row.tracestate):
                return self._publisher.publish_message(op.message)
        if isinstance(op, Wait):
            self._wake.wait(op.timeout)
            self._wake.clear()
            return None
        return getattr(self._publisher, op.name)(*op.args)


class _ThreadsafeWake:
    """Sets an asyncio.Event from any thread (the store's listener runs in one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        self._loop = loop
        self._event = event
        self._loop_thread = threading.get_ident()  # made in the loop's thread

    def set(self) -> None:
        if threading.get_ident() == self._loop_thread:
            self._event.set()  # a future's callback on the loop: no self-pipe write
            return
        with contextlib.suppress(RuntimeError):  # the loop closed
            self._loop.call_soon_threadsafe(self._event.set)


class AsyncOutboxRelay:
    """:class:`OutboxRelay` for asyncio: ``await relay.run()`` as a task of the application's
    event loop, publishing through an ``AsyncPublisher`` (the ``aio`` extra). Its database
    calls run in one worker thread of its own. ``stop()`` is a plain call, safe from the loop
    or any thread; ``await relay.run()`` returns once what was in flight is settled.
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
        from reliable_amqp._async.publisher import AsyncPublisher

        config = _Config(
            db, table=table, batch=batch, poll_interval=poll_interval,
            rescan_interval=rescan_interval, rebalance_interval=rebalance_interval,
            stop_timeout=stop_timeout, long_transaction_warning=long_transaction_warning,
            name=name,
        )  # fmt: skip
        publisher_options.setdefault("max_in_flight", DEFAULT_RELAY_WINDOW)
        self._config = config
        self._publisher = AsyncPublisher(url, **publisher_options)
        self._meter_provider = publisher_options.get("meter_provider")
        self._window = self._publisher.options.max_in_flight
        self._relay: RelayLoop | None = None
        self._event: asyncio.Event | None = None
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False
        self._ran = False

    @property
    def name(self) -> str:
        """This relay's name (``outbox status`` shows it)."""
        return self._config.name

    async def run(self, *, until_empty: bool = False) -> None:
        """:meth:`OutboxRelay.run`, awaited. Cancelling the task stops the relay as ``stop()``
        does (what is in flight is settled first, within ``stop_timeout``)."""
        if self._ran:
            raise ConfigurationError("run(): a relay runs once")
        self._ran = True
        loop = asyncio.get_running_loop()
        self._aio_loop = loop
        self._event = asyncio.Event()
        relay = self._config.loop(
            self._window,
            self._meter_provider,
            _ThreadsafeWake(loop, self._event),
            asyncio_exception,
        )
        relay.stopping = self._stop_requested
        self._relay = relay
        db_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="reliable-amqp-outbox-db"
        )
        try:
            try:
                await self._drive(relay.steps(until_empty), db_thread)
            finally:
                relay.stopping = True
                await asyncio.shield(
                    self._drive(relay.shutdown(self._config.stop_timeout), db_thread)
                )
        finally:
            db_thread.shutdown(wait=False)

    def stop(self) -> None:
        """Stop reading; ``run()`` settles what is in flight and returns. Any thread."""
        self._stop_requested = True
        relay, loop, event = self._relay, self._aio_loop, self._event
        if relay is not None:
            relay.stopping = True
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def stats(self) -> RelayStats | None:
        """Counters since the relay started (None before ``run()``)."""
        return self._relay.stats() if self._relay is not None else None

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this relay owns now."""
        return frozenset(self._relay.ownership.owned) if self._relay is not None else frozenset()

    async def _drive(self, steps: Steps, db_thread: concurrent.futures.Executor) -> None:
        result: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = steps.throw(error) if error is not None else steps.send(result)
            except StopIteration:
                return
            result = error = None
            try:
                result = await self._do(op, db_thread)
            except Exception as exc:
                error = exc

    async def _do(self, op: Op, db_thread: concurrent.futures.Executor) -> Any:
        loop = asyncio.get_running_loop()
        if isinstance(op, StoreCall):
            call = getattr(self._config.store, op.name)
            return await loop.run_in_executor(db_thread, lambda: call(*op.args))
        if isinstance(op, PublishRun):
            return await _publish_run(self._publisher, op)
        if isinstance(op, PublishOne):
            with continue_trace(op.row.traceparent, op.row.tracestate):
                return await self._publisher.publish_message(op.message)
        if isinstance(op, Wait):
            event = self._event
            assert event is not None
            await wait_set(event, op.timeout)  # (a cancellation is never lost: _compat.waits)
            event.clear()
            return None
        if op.name == "connect":
            return await self._publisher.connect()
        if op.name == "flush":
            return await self._publisher.flush(*op.args)
        return await self._publisher.aclose(*op.args)
