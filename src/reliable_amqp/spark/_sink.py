"""AmqpSink: publish a DataFrame's rows through the confirming publisher, at least once.

Three ways in, one partition-publishing function underneath:

- ``df.foreachPartition(sink)``: the sink is a picklable callable taking a partition's ``Row``
  objects (columns are checked on each partition's first row, before it sends anything);
- ``sink.write(df)``: checks the schema on the driver, then moves rows to Python in Arrow batches
  (``mapInArrow``, measurably faster than Row objects) and returns the totals;
- ``writeStream.foreachBatch(sink.for_batch)``: ``write`` with the batch id in the message ids.

All three work on classic sessions and through Spark Connect (``SparkSession.builder.remote``).
Connect has no ``df.rdd``: there ``write(df, via="rows")`` runs through ``mapInArrow`` too and
turns each batch into ``Row`` objects with PySpark's own converter (what Connect's
``foreachPartition`` does), so the rows path sees the same values either way.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pyspark import TaskContext
from pyspark.sql import DataFrame, Row
from pyspark.sql.types import StructType

from reliable_amqp import ConfigurationError, PublisherOptions
from reliable_amqp._core.options import redact_url
from reliable_amqp.spark._mapping import ColumnPlan
from reliable_amqp.spark._publish import (
    PartitionResult,
    SinkConfig,
    chunk_rows,
    publish_partition,
)
from reliable_amqp.spark._totals import SinkTotals, driver_accumulator
from reliable_amqp.spark._trace import capture
from reliable_amqp.spark._workers import check_workers

_RESULT_SCHEMA = "partition int, rows long, seconds double, publisher string"


@dataclass(frozen=True, slots=True)
class WriteSummary:
    """Totals of one write: every row counted was confirmed by the broker."""

    rows: int
    partitions: int
    seconds: float
    #: the id component of this write: message ids are ``f"{job}:{partition}:{position}"``
    job: str
    #: the cached publishers (``"pid:serial"``) that served the tasks: fewer than the tasks when
    #: Python workers reused their connections
    publishers: frozenset[str] = frozenset()

    @property
    def rate(self) -> float:
        """Rows per second, end to end on the driver (job scheduling included)."""
        return self.rows / self.seconds if self.seconds > 0 else 0.0


class AmqpSink:
    """Publish DataFrame rows to an AMQP broker, confirming every one (at least once).

    ``AmqpSink(url, exchange="", routing_key=None, routing_key_column="routing_key",
    body_column="body", mandatory=True, id_prefix=None, flush_timeout=None, **options)``;
    ``options`` are :class:`~reliable_amqp.PublisherOptions` (``delivery_timeout``,
    ``max_in_flight``, ``nack_policy={"max_attempts": 3}``, ...). Everything is validated here, on
    the driver. Each task publishes its rows, waits for every confirm and raises
    :class:`~reliable_amqp.spark.RowsNotConfirmed` if any row failed, so Spark retries it; the
    retry republishes the same message ids, which consumers use to drop duplicates.

    Message ids come from a ``message_id`` column when there is one (and the row's value is not
    null); otherwise ``f"{job}:{partition}:{position}"``. ``job`` is ``id_prefix`` when given,
    otherwise a uuid minted on the driver: per ``write()`` call, per sink for
    ``foreachPartition`` (plus the stage id, so two jobs never share ids), per micro-batch for
    ``for_batch`` (the streaming query id and batch id, stable across restarts).

    ``df.foreachPartition(sink)`` reports to the driver through an accumulator (classic
    sessions): :attr:`totals`, logged at INFO as each task's update arrives. A write started
    inside an OpenTelemetry span carries that trace context to the tasks.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        exchange: str = "",
        routing_key: str | None = None,
        routing_key_column: str = "routing_key",
        body_column: str = "body",
        mandatory: bool = True,
        id_prefix: str | None = None,
        flush_timeout: float | None = None,
        **options: Any,
    ) -> None:
        self.config = SinkConfig(
            publisher=PublisherOptions.create(url, **options),
            exchange=exchange,
            routing_key=routing_key,
            routing_key_column=routing_key_column,
            body_column=body_column,
            mandatory=mandatory,
            id_prefix=id_prefix,
            flush_timeout=flush_timeout,
        )
        self._job = uuid.uuid4().hex
        self._totals: Any = driver_accumulator()
        self._trace: dict[str, str] | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> AmqpSink:
        """A sink from string options, as the ``"amqp"`` data source takes them."""
        sink = cls.__new__(cls)
        sink.config = SinkConfig.from_strings(options)
        sink._job = uuid.uuid4().hex
        sink._totals = driver_accumulator()
        sink._trace = None
        return sink

    @property
    def totals(self) -> SinkTotals | None:
        """What this sink's ``df.foreachPartition(sink)`` jobs confirmed so far, on the driver:
        rows and partitions of the tasks that succeeded (Spark drops the updates of failed
        attempts; their rows are in the job's error). None through Spark Connect, which has no
        accumulators: use ``sink.write(df, via="rows")`` there for totals."""
        if self._totals is None:
            return None
        value: SinkTotals = self._totals.value
        return value

    def __getstate__(self) -> dict[str, Any]:
        # Pickled on the driver when a job ships the sink (foreachPartition): make the
        # accumulator if the session came after the sink, and take the caller's trace context.
        if self._totals is None:
            self._totals = driver_accumulator()
        state = dict(self.__dict__)
        state["_trace"] = capture(self.config.publisher)
        return state

    def __repr__(self) -> str:
        urls = ", ".join(redact_url(u) for u in self.config.publisher.urls)
        return (
            f"AmqpSink([{urls}], exchange={self.config.exchange!r}, "
            f"routing_key={self.config.routing_key!r})"
        )

    # --- foreachPartition ----------------------------------------------------------------------

    def __call__(self, rows: Iterable[Row]) -> None:
        """Publish one partition's ``Row`` objects (``df.foreachPartition(sink)``)."""
        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        stage = ctx.stageId() if ctx is not None else 0
        job = self.config.id_prefix or f"{self._job}:s{stage}"
        result = publish_partition(
            self.config,
            chunk_rows(None, self.config, rows),
            f"{job}:{partition}",
            partition,
            self._trace,
        )
        if self._totals is not None:
            self._totals.add(SinkTotals(result.rows, 1))

    # --- driver-side writes --------------------------------------------------------------------

    def check(self, schema: StructType) -> ColumnPlan:
        """Check a schema (``df.schema``) against the sink; raise ConfigurationError if it does
        not fit. ``write`` and ``for_batch`` call this before anything is sent."""
        return self.config.plan(schema)

    def write(self, df: DataFrame, *, via: Literal["arrow", "rows"] = "arrow") -> WriteSummary:
        """Publish every row of ``df``; return the totals once every row is confirmed.

        ``via="arrow"`` (default) hands rows to Python as Arrow batches; ``via="rows"`` as
        ``Row`` objects (slower; kept for comparison). Raises (a Spark error naming
        :class:`RowsNotConfirmed`) when a partition still fails after Spark's task retries.
        """
        return self._write(df, self.config.id_prefix or uuid.uuid4().hex, via)

    def for_batch(self, df: DataFrame, batch_id: int) -> None:
        """``writeStream.foreachBatch(sink.for_batch)``: publish one micro-batch.

        Message ids carry the streaming query id and ``batch_id``, so a batch replayed after a
        failure or restart (same checkpoint) republishes the same ids.
        """
        prefix = self.config.id_prefix or _streaming_query_id(df) or self._job
        self._write(df, f"{prefix}:b{batch_id}", "arrow")

    def _write(self, df: DataFrame, job: str, via: str) -> WriteSummary:
        plan = self.check(df.schema)
        if not is_connect(df):
            check_workers(df.sparkSession)
        started = time.perf_counter()
        trace = capture(self.config.publisher)
        if via == "arrow":
            task = _ArrowTask(self.config, plan, job, trace)
            results = _results(df.mapInArrow(task, _RESULT_SCHEMA).collect())
        elif via == "rows" and is_connect(df):  # Spark Connect has no RDDs
            rows_task = _ArrowRowTask(self.config, plan, job, df.schema, trace)
            results = _results(df.mapInArrow(rows_task, _RESULT_SCHEMA).collect())
        elif via == "rows":
            results = df.rdd.mapPartitions(_RowTask(self.config, plan, job, trace)).collect()
        else:
            raise ConfigurationError(f'via must be "arrow" or "rows", not {via!r}')
        return WriteSummary(
            rows=sum(r.rows for r in results),
            partitions=len(results),
            seconds=time.perf_counter() - started,
            job=job,
            publishers=frozenset(r.publisher for r in results),
        )


def is_connect(df: DataFrame) -> bool:
    """Whether ``df`` belongs to a Spark Connect session (no RDDs, no SparkContext there)."""
    # By module, not isinstance: importing pyspark.sql.connect needs the connect extras (grpcio).
    return type(df).__module__.startswith("pyspark.sql.connect.")


def _results(collected: Iterable[Row]) -> list[PartitionResult]:
    return [PartitionResult(r.partition, r.rows, r.seconds, r.publisher) for r in collected]


def _result_batch(result: PartitionResult) -> Any:
    import pyarrow as pa

    return pa.record_batch(
        [
            pa.array([result.partition], pa.int32()),
            pa.array([result.rows], pa.int64()),
            pa.array([result.seconds], pa.float64()),
            pa.array([result.publisher], pa.string()),
        ],
        names=["partition", "rows", "seconds", "publisher"],
    )


class _ArrowTask:
    """The ``mapInArrow`` function: publish a partition's Arrow batches, yield its counts."""

    def __init__(
        self, config: SinkConfig, plan: ColumnPlan, job: str, trace: dict[str, str] | None
    ) -> None:
        self.config = config
        self.plan = plan
        self.job = job
        self.trace = trace

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        yield _result_batch(publish_arrow(self.config, self.plan, self.job, batches, self.trace))


class _ArrowRowTask:
    """``via="rows"`` on Spark Connect: Arrow batches in, ``Row`` objects to the publisher."""

    def __init__(
        self,
        config: SinkConfig,
        plan: ColumnPlan,
        job: str,
        schema: StructType,
        trace: dict[str, str] | None,
    ) -> None:
        self.config = config
        self.plan = plan
        self.job = job
        self.schema = schema
        self.trace = trace

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        partition = _partition_id()
        rows = (row for batch in batches for row in _arrow_rows(batch, self.schema))
        yield _result_batch(
            publish_partition(
                self.config,
                chunk_rows(self.plan, self.config, rows),
                f"{self.job}:{partition}",
                partition,
                self.trace,
            )
        )


def _arrow_rows(batch: Any, schema: StructType) -> list[Row]:
    """One Arrow batch as ``Row`` objects, converted as Spark Connect converts collected rows."""
    import pyarrow as pa

    try:  # PySpark >= 4.1 keeps the converter here; 4.0 kept it in the connect package
        from pyspark.sql.conversion import ArrowTableToRowsConversion
    except ImportError:  # pragma: no cover - depends on the PySpark version
        from pyspark.sql.connect.conversion import (  # type: ignore[no-redef, attr-defined]
            ArrowTableToRowsConversion,
        )
    rows: list[Row] = ArrowTableToRowsConversion.convert(pa.Table.from_batches([batch]), schema)
    return rows


class _RowTask:
    """The ``rdd.mapPartitions`` function: publish a partition's Rows, yield its counts."""

    def __init__(
        self, config: SinkConfig, plan: ColumnPlan, job: str, trace: dict[str, str] | None
    ) -> None:
        self.config = config
        self.plan = plan
        self.job = job
        self.trace = trace

    def __call__(self, rows: Iterable[Row]) -> Iterator[PartitionResult]:
        partition = _partition_id()
        yield publish_partition(
            self.config,
            chunk_rows(self.plan, self.config, rows),
            f"{self.job}:{partition}",
            partition,
            self.trace,
        )


def publish_arrow(
    config: SinkConfig,
    plan: ColumnPlan,
    job: str,
    batches: Iterable[Any],
    trace: dict[str, str] | None = None,
) -> PartitionResult:
    """Publish one partition given as Arrow record batches (columns in schema order)."""
    partition = _partition_id()
    chunks = (plan.chunk_from_arrow(batch) for batch in batches)
    return publish_partition(config, chunks, f"{job}:{partition}", partition, trace)


def _partition_id() -> int:
    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else 0


def _streaming_query_id(df: DataFrame) -> str | None:
    try:
        value = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:  # Spark Connect has no SparkContext: fall back to the sink's own id
        return None
    return str(value) if value else None
