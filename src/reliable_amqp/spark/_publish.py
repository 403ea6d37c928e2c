"""The one partition-publishing function, its configuration, and the per-process publisher cache.

Every entry point (``df.foreachPartition(sink)``, ``sink.write(df)``, ``sink.for_batch`` and the
``"amqp"`` data source, batch and streaming) ends in :func:`publish_partition`: publish every row
with streaming confirms, wait for every confirm (bounded), and raise :class:`RowsNotConfirmed`
if any row failed, so that Spark retries the task (where it retries tasks). Retries republish the
same message ids.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pyspark.sql.types import StructType

from reliable_amqp import (
    AmqpConnectionError,
    ConfigurationError,
    Confirmation,
    DeliveryTimeout,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    Publisher,
    PublisherClosed,
    PublisherOptions,
    PublishError,
    PublishTimeout,
    ReliableAmqpError,
    State,
    Stats,
)
from reliable_amqp._otel import check_provider_options
from reliable_amqp.spark._cache import (
    cached_publisher,
    publisher_tag,
    retire_publisher,
)
from reliable_amqp.spark._interrupt import TaskInterrupted, TaskLink
from reliable_amqp.spark._logging import log_from_env
from reliable_amqp.spark._mapping import Chunk, ColumnPlan, plan_for_row, plan_for_schema
from reliable_amqp.spark._trace import attached

log = logging.getLogger("reliable_amqp.spark")

log_from_env()

#: Options of the sink itself; every other option is a publisher option.
SINK_OPTIONS: tuple[str, ...] = (
    "url",
    "exchange",
    "routing_key",
    "routing_key_column",
    "body_column",
    "mandatory",
    "id_prefix",
    "flush_timeout",
)
#: Options Spark passes to a data source that are not ours to interpret.
SPARK_OPTIONS: frozenset[str] = frozenset(
    {
        "path",  # save(path), start(path)
        "paths",  # DataSourceUtils: several paths (readers; never ours either)
        "checkpointlocation",  # writeStream.option("checkpointLocation", ...)
        "queryname",  # writeStream.queryName(...), start(queryName=...)
        "__partition_columns",  # partitionBy(...) (DataSourceUtils.PARTITIONING_COLUMNS_KEY)
        "__clustering_columns",  # clusterBy(...) (DataSourceUtils.CLUSTERING_COLUMNS_KEY)
    }
)
#: Rows per chunk on the Row path (the Arrow path uses Spark's Arrow batches).
ROW_CHUNK = 1000
#: Rows handed to the publisher between two looks at whether Spark still wants the task.
SLICE = 1000
#: Futures kept before a sweep reads every settled one (not only those at the front).
_SWEEP_ALL = 50_000
_FLUSH_SLACK = 30.0
_SAMPLE_IDS = 3


@dataclass(frozen=True, slots=True)
class SinkConfig:
    """Where and how rows are published; built (and validated) on the driver, pickled to tasks."""

    publisher: PublisherOptions
    exchange: str = ""
    routing_key: str | None = None
    routing_key_column: str = "routing_key"
    body_column: str = "body"
    mandatory: bool = True
    id_prefix: str | None = None
    flush_timeout: float | None = None

    def __post_init__(self) -> None:
        # provider objects would be pickled to the executors: each process uses its own globals
        check_provider_options(self.publisher, "the Spark sink")
        for name in ("exchange", "routing_key_column", "body_column"):
            if not isinstance(getattr(self, name), str):
                raise ConfigurationError(f"{name} must be a str, got {getattr(self, name)!r}")
        if self.routing_key is not None and not isinstance(self.routing_key, str):
            raise ConfigurationError(f"routing_key must be a str, got {self.routing_key!r}")
        if not isinstance(self.mandatory, bool):
            raise ConfigurationError(f"mandatory must be a bool, got {self.mandatory!r}")
        if self.id_prefix is not None and (
            not isinstance(self.id_prefix, str) or not self.id_prefix
        ):
            raise ConfigurationError(f"id_prefix must be a non-empty str, got {self.id_prefix!r}")
        if self.flush_timeout is not None and not (
            isinstance(self.flush_timeout, (int, float))
            and math.isfinite(self.flush_timeout)
            and self.flush_timeout > 0
        ):
            raise ConfigurationError(
                f"flush_timeout must be a number of seconds > 0, got {self.flush_timeout!r}"
            )

    @property
    def flush_deadline(self) -> float:
        """How long a task waits for its confirms: ``flush_timeout``, by default the delivery
        timeout plus 30 s (every message is settled by its own deadline before that)."""
        if self.flush_timeout is not None:
            return float(self.flush_timeout)
        return self.publisher.delivery_timeout + _FLUSH_SLACK

    def plan(self, schema: StructType) -> ColumnPlan:
        """Check a DataFrame schema against this configuration (raises before anything is sent)."""
        return plan_for_schema(
            schema,
            self.body_column,
            self.routing_key_column,
            has_routing_key=self.routing_key is not None,
        )

    def plan_for_row(self, row: Any) -> ColumnPlan:
        """Plan from a partition's first Row (no schema on the ``foreachPartition`` path)."""
        return plan_for_row(
            row,
            self.body_column,
            self.routing_key_column,
            has_routing_key=self.routing_key is not None,
        )

    @classmethod
    def from_strings(cls, options: Mapping[str, str]) -> SinkConfig:
        """Build from string options (a data source's, lower-cased by Spark).

        ``url`` is required (several, comma-separated, to fail over); ``exchange``,
        ``routing_key``, ``routing_key_column``, ``body_column``, ``mandatory`` (true/false),
        ``id_prefix`` and ``flush_timeout`` configure the sink; everything else goes to
        :meth:`PublisherOptions.from_strings` (``delivery_timeout``, ``nack_policy.max_attempts``).
        """
        given = {k.lower(): v for k, v in options.items() if k.lower() not in SPARK_OPTIONS}
        url = given.pop("url", None)
        if not url:
            raise ConfigurationError(
                'the amqp data source needs .option("url", "amqp://user:pass@host:5672/vhost")'
            )
        sink: dict[str, Any] = {}
        for name in ("exchange", "routing_key", "routing_key_column", "body_column", "id_prefix"):
            if name in given:
                sink[name] = given.pop(name)
        if "mandatory" in given:
            raw = given.pop("mandatory").strip().lower()
            if raw not in ("true", "false"):
                raise ConfigurationError(f"mandatory must be true or false, got {raw!r}")
            sink["mandatory"] = raw == "true"
        if "flush_timeout" in given:
            raw = given.pop("flush_timeout")
            try:
                sink["flush_timeout"] = float(raw)
            except ValueError:
                raise ConfigurationError(f"flush_timeout must be a number, got {raw!r}") from None
        urls = [u.strip() for u in url.split(",") if u.strip()]
        try:
            publisher = PublisherOptions.from_strings(urls, given)
        except ConfigurationError as exc:
            if "unknown publisher option" not in str(exc):
                raise
            raise ConfigurationError(f"{exc}; sink options: {', '.join(SINK_OPTIONS)}") from None
        return cls(publisher=publisher, **sink)


# --- results and failures -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionResult:
    """What one task published: every row counted here was confirmed by the broker."""

    partition: int
    rows: int
    seconds: float
    #: which cached publisher served the task (``"pid:serial"``): tasks that share one reused it
    publisher: str = ""


class RowsNotConfirmed(ReliableAmqpError):
    """Some rows of a partition were not confirmed; raised in the task so that Spark retries it
    (where it retries tasks: not under a ``local[N]`` master).

    ``reasons`` maps a reason (error class and reply text) to how many rows failed so.
    """

    retriable = True

    def __init__(
        self, partition: int, rows: int, reasons: Mapping[str, int], sample_ids: Sequence[str]
    ) -> None:
        failed = sum(reasons.values())
        why = "; ".join(f"{n} x {reason}" for reason, n in sorted(reasons.items(), key=_by_count))
        super().__init__(
            f"{failed} of {rows} rows of partition {partition} were not confirmed by the broker: "
            f"{why} (message ids such as {', '.join(sample_ids)}). Spark retries the task when "
            "it allows retries (spark.task.maxFailures; a local[N] master does not, local[N,F] "
            "does); a retry republishes the partition with the same message ids."
        )
        self.partition = partition
        self.rows = rows
        self.failed = failed
        self.reasons = dict(reasons)
        self.sample_ids = list(sample_ids)


def _by_count(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


def failure_reason(exc: BaseException) -> str:
    """A row failure as a grouping key: the error class and what the broker said."""
    name = type(exc).__name__
    if isinstance(exc, (MessageReturned, MessageRejected)):
        return f"{name} ({exc.reply_code} {exc.reply_text})"
    if isinstance(exc, MessageNacked):
        return (
            f"{name} (nacked by the broker, e.g. a full queue with x-overflow=reject-publish; "
            "nack_policy spent)"
        )
    if isinstance(exc, DeliveryTimeout):
        return f"{name} (not confirmed within the {exc.timeout:g} s delivery_timeout)"
    if isinstance(exc, PublisherClosed):
        return f"{name} ({exc.reason or 'publisher closed'})"
    if isinstance(exc, InvalidMessage):
        return f"{name} (invalid {exc.field}: {exc.problem})"
    return f"{name} ({exc})"


def _failures(stats: Stats) -> int:
    return stats.failed_nacked + stats.returned + stats.rejected + stats.timed_out + stats.closed


class _Outcome:
    """Failures of one partition, grouped; read from its futures in the task's own thread.

    The futures are swept as the task goes (the settled ones from the front, in order), not
    through done-callbacks, which would run on the publisher's I/O thread, once per message.
    A settled future's outcome is read only when the publisher's failure counters say that
    something failed and was not read yet: the engine counts a failure before it settles the
    future, so a future seen settled before the counters were read, while they show nothing
    new, was confirmed. (A publisher serves one task at a time in a Spark Python worker; when
    it serves several threads at once, their failures only make this read more futures.)
    """

    def __init__(self, publisher: Publisher) -> None:
        self.reasons: dict[str, int] = {}
        self.sample_ids: list[str] = []
        self.pending: deque[Future[Confirmation]] = deque()
        self._stats = publisher.stats
        #: the publisher's failure count that the failures read so far account for
        self._accounted = _failures(publisher.stats())

    def sweep(self, everything: bool = False) -> None:
        """Take the settled futures: those at the front (in order), or every settled one when
        ``everything`` (the unsettled ones stay); read the outcome of those that may have
        failed."""
        pending = self.pending
        settled: list[Future[Confirmation]] = []
        while pending and pending[0].done():
            settled.append(pending.popleft())
        if everything and pending:
            left: deque[Future[Confirmation]] = deque()
            for future in pending:
                (settled if future.done() else left).append(future)
            self.pending = left
        if not settled or _failures(self._stats()) == self._accounted:
            return
        for future in settled:
            exc = future.exception()
            if exc is not None:
                self._accounted += 1
                message = getattr(exc, "message", None)
                self.add(exc, getattr(message, "message_id", "?"))

    def add(self, exc: BaseException, message_id: str) -> None:
        reason = failure_reason(exc)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if len(self.sample_ids) < _SAMPLE_IDS:
            self.sample_ids.append(message_id)


# --- the partition-publishing function ------------------------------------------------------------


def publish_partition(
    config: SinkConfig,
    chunks: Iterable[Chunk],
    id_base: str,
    partition: int,
    trace: Mapping[str, str] | None = None,
) -> PartitionResult:
    """Publish every row of one partition and wait for every confirm; raise if any failed.

    Rows without a ``message_id`` get ``f"{id_base}:{position}"``: the same on every attempt of
    the task. If reading the rows fails (an upstream error), what was already handed to the
    publisher is flushed first, so the cached publisher starts the next task clean. ``trace``
    is the driver's trace context (propagation headers): the messages' spans continue it.
    """
    with attached(trace):
        return _publish_partition(config, chunks, id_base, partition)


def _publish_partition(
    config: SinkConfig, chunks: Iterable[Chunk], id_base: str, partition: int
) -> PartitionResult:
    started = time.perf_counter()
    link = TaskLink()
    publisher = cached_publisher(config.publisher)
    outcome = _Outcome(publisher)
    position = 0
    try:
        for chunk in chunks:
            for start in range(0, chunk.size, SLICE):
                if link.ended():
                    raise TaskInterrupted(partition, position + start)
                _publish_slice(
                    publisher,
                    config,
                    chunk,
                    start,
                    min(chunk.size, start + SLICE),
                    position,
                    id_base,
                    outcome,
                )
                outcome.sweep(len(outcome.pending) > _SWEEP_ALL)
            position += chunk.size
    except TaskInterrupted as exc:
        # Nobody reads this task's result any more: leave what is in flight to the publisher
        # (its window bounds it) and stop, without waiting for confirms.
        log.warning("reliable-amqp: %s", exc)
        raise
    except BaseException as exc:
        _settle_after_error(config, publisher, exc)
        raise
    left = publisher.flush(config.flush_deadline)
    if left:
        # Whatever is still open fails as PublisherClosed (and is counted) when it closes.
        log.warning(
            "reliable-amqp: %d confirms still missing after %g s", left, config.flush_deadline
        )
        retire_publisher(config.publisher, publisher)
    outcome.sweep(everything=True)
    if outcome.reasons:
        raise RowsNotConfirmed(partition, position, outcome.reasons, outcome.sample_ids)
    seconds = time.perf_counter() - started
    log.info(
        "partition %d: %d rows confirmed in %.2f s (ids %s:*)",
        partition,
        position,
        seconds,
        id_base,
    )
    return PartitionResult(partition, position, seconds, publisher_tag(config.publisher, publisher))


def _publish_slice(  # noqa: PLR0917
    publisher: Publisher,
    config: SinkConfig,
    chunk: Chunk,
    start: int,
    end: int,
    position: int,
    id_base: str,
    outcome: _Outcome,
) -> None:
    """Hand rows ``start:end`` of ``chunk`` to the publisher (``position``: the chunk's first
    row in the partition); their futures join ``outcome``."""
    publish = publisher.publish
    append = outcome.pending.append
    bodies = chunk.bodies
    exchanges = chunk.exchanges
    keys = chunk.routing_keys
    ids = chunk.message_ids
    properties = chunk.properties
    exchange = config.exchange
    key = config.routing_key or ""
    mandatory = config.mandatory
    if exchanges is None and keys is None and ids is None and not properties:
        # only the body and the id differ: the common case, one publish_many() call a slice
        prefix = f"{id_base}:"
        ids_here = [f"{prefix}{n}" for n in range(position + start, position + end)]
        slice_bodies = bodies[start:end]
        if None not in slice_bodies:
            try:
                outcome.pending.extend(
                    publisher.publish_many(
                        exchange, key, slice_bodies, mandatory=mandatory, message_ids=ids_here
                    )
                )
                return
            except InvalidMessage:
                pass  # nothing of the call was sent: one by one, to fail only the bad rows
        for body, message_id in zip(slice_bodies, ids_here, strict=True):
            if body is None:
                outcome.add(InvalidMessage("body", "is null"), message_id)
                continue
            try:
                append(publish(exchange, key, body, mandatory=mandatory, message_id=message_id))
            except InvalidMessage as exc:
                outcome.add(exc, message_id)
        return
    for i in range(start, end):
        message_id = (ids[i] if ids is not None else None) or f"{id_base}:{position + i}"
        body = bodies[i]
        if body is None:
            outcome.add(InvalidMessage("body", "is null"), message_id)
            continue
        extra = {name: values[i] for name, values in properties if values[i] is not None}
        try:
            append(
                publish(
                    (exchanges[i] if exchanges is not None else None) or exchange,
                    (keys[i] if keys is not None else None) or key,
                    body,
                    mandatory=mandatory,
                    message_id=message_id,
                    **extra,
                )
            )
        except InvalidMessage as exc:
            outcome.add(exc, message_id)


def _settle_after_error(config: SinkConfig, publisher: Publisher, exc: BaseException) -> None:
    broken = isinstance(exc, (AmqpConnectionError, PublishError, PublishTimeout))
    if broken or publisher.state in (State.CLOSING, State.CLOSED):
        # The publisher itself failed (closed, gave up reconnecting): rebuild it next time.
        retire_publisher(config.publisher, publisher)
        return
    if publisher.flush(config.flush_deadline):
        retire_publisher(config.publisher, publisher)


def chunk_rows(plan: ColumnPlan | None, config: SinkConfig, rows: Iterable[Any]) -> Iterator[Chunk]:
    """Rows in chunks of :data:`ROW_CHUNK`; planned from the first row when ``plan`` is None."""
    buffer: list[Any] = []
    for row in rows:
        if plan is None:
            plan = config.plan_for_row(row)
        buffer.append(row)
        if len(buffer) >= ROW_CHUNK:
            yield plan.chunk_from_rows(buffer)
            buffer = []
    if buffer and plan is not None:
        yield plan.chunk_from_rows(buffer)
