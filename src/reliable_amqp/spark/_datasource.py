"""The ``"amqp"`` Python Data Source, for ``df.write`` and ``df.writeStream``, and for
``spark.read`` and ``spark.readStream`` of streams (:mod:`reliable_amqp.spark._read`).

Register it once per session with :func:`register` (or ``spark.dataSource.register``).
Options arrive as strings, lower-cased by Spark; see :meth:`SinkConfig.from_strings`. The schema
is checked when Spark asks for a writer, on the driver, before any task runs. Each task publishes
its partition (from Arrow batches) with :func:`publish_partition` and returns an
:class:`AmqpCommitMessage` with its counts; the driver-side ``commit`` logs the totals at INFO,
and ``abort`` logs what was confirmed and how many partitions failed, at WARNING. Both run in a
Python worker Spark starts on the driver, which configures no logging: there they log to stderr
unless ``RELIABLE_AMQP_SPARK_LOG`` or a handler says otherwise.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from reliable_amqp import ConfigurationError
from reliable_amqp.spark._logging import driver_log
from reliable_amqp.spark._mapping import ColumnPlan
from reliable_amqp.spark._publish import SinkConfig
from reliable_amqp.spark._read import AmqpBatchReader, AmqpStreamReader, read_schema
from reliable_amqp.spark._read_options import ReadConfig
from reliable_amqp.spark._sink import publish_arrow
from reliable_amqp.spark._trace import capture
from reliable_amqp.spark._workers import check_workers

log = logging.getLogger("reliable_amqp.spark")

_STREAM_QUERY_ID = "sql.streaming.queryId"
_STREAM_BATCH_ID = "streaming.sql.batchId"


@dataclass
class AmqpCommitMessage(WriterCommitMessage):
    """What one task reports to the driver: every row counted here was confirmed."""

    partition: int
    rows: int
    seconds: float
    job: str
    #: the cached publisher that served the task (``"pid:serial"``)
    publisher: str = ""


@dataclass(frozen=True)
class CommitTotals:
    """The totals a driver-side ``commit`` computes (and logs)."""

    rows: int
    partitions: int
    job: str
    publishers: int = 0
    #: tasks that reported nothing: they failed (their rows are in the job's error)
    failed_partitions: int = 0

    def __str__(self) -> str:
        failed = (
            f"; {self.failed_partitions} partition{'' if self.failed_partitions == 1 else 's'} "
            "failed"
            if self.failed_partitions
            else ""
        )
        return (
            f"{self.rows} rows confirmed from {self.partitions} "
            f"partition{'' if self.partitions == 1 else 's'} "
            f"(ids {self.job}:*; {self.publishers} cached "
            f"publisher{'' if self.publishers == 1 else 's'}){failed}"
        )


def commit_totals(messages: Sequence[WriterCommitMessage | None], job: str) -> CommitTotals:
    """Sum the per-partition counts of the tasks that succeeded; count those that did not."""
    done = [m for m in messages if isinstance(m, AmqpCommitMessage)]
    publishers = len({m.publisher for m in done})
    failed = len(messages) - len(done)
    return CommitTotals(sum(m.rows for m in done), len(done), job, publishers, failed)


class AmqpDataSource(DataSource):
    """Format ``"amqp"``: write DataFrames (batch or streaming) to an AMQP broker, and read
    streams (RabbitMQ and LavinMQ stream queues) exactly once into checkpointed sinks.

    ``.mode("append")`` is the only save mode (messages cannot be overwritten). Options: ``url``
    (required), ``exchange``, ``routing_key``, ``routing_key_column``, ``body_column``,
    ``mandatory``, ``id_prefix``, ``flush_timeout``, and every publisher option as a string
    (``delivery_timeout``, ``max_in_flight``, ``nack_policy.max_attempts``, ...). The options
    Spark adds itself (``queryName``, ``checkpointLocation``, ``path``, ...) are ignored.
    Reading takes ``stream`` (or ``superStream``), ``startingOffsets``, ``endingOffsets``
    (batch), ``maxMessagesPerTrigger`` (streaming), ``minPartitions``, ``failOnDataLoss``,
    ``prefetch`` and the connection options (docs/spark.md, "Reading").
    """

    @classmethod
    def name(cls) -> str:
        """The format name: ``"amqp"``."""
        return "amqp"

    def schema(self) -> StructType:
        """The columns of a read (writes take the DataFrame's own schema)."""
        return read_schema()

    def reader(self, schema: StructType) -> AmqpBatchReader:
        """A batch reader (on the driver: checks the options and that the queue is a stream)."""
        return AmqpBatchReader(ReadConfig.from_strings(dict(self.options), streaming=False))

    def streamReader(self, schema: StructType) -> AmqpStreamReader:
        """A streaming reader (on the driver: checks the options and the stream)."""
        return AmqpStreamReader(ReadConfig.from_strings(dict(self.options), streaming=True))

    def _config(self, schema: StructType, overwrite: bool) -> tuple[SinkConfig, ColumnPlan]:
        if overwrite:
            raise ConfigurationError(
                'the amqp data source only appends: use .mode("append") '
                "(published messages cannot be overwritten)"
            )
        config = SinkConfig.from_strings(dict(self.options))
        return config, config.plan(schema)

    def writer(self, schema: StructType, overwrite: bool) -> AmqpBatchWriter:
        """A batch writer (called on the driver; checks options and schema)."""
        config, plan = self._config(schema, overwrite)
        writer = AmqpBatchWriter(config, plan, config.id_prefix or uuid.uuid4().hex)
        writer.trace = capture(config.publisher)  # the driver's trace context, if any
        return writer

    def streamWriter(self, schema: StructType, overwrite: bool) -> AmqpStreamWriter:
        """A streaming writer (called on the driver; checks options and schema)."""
        config, plan = self._config(schema, overwrite)
        return AmqpStreamWriter(config, plan, uuid.uuid4().hex)


class AmqpBatchWriter(DataSourceArrowWriter):
    """Writes one batch job: ids are ``f"{job}:{partition}:{position}"``."""

    def __init__(self, config: SinkConfig, plan: ColumnPlan, job: str) -> None:
        self.config = config
        self.plan = plan
        self.job = job
        self.trace: dict[str, str] | None = None

    def write(self, iterator: Iterator[Any]) -> AmqpCommitMessage:
        """Publish one partition (Arrow batches); return its counts."""
        result = publish_arrow(self.config, self.plan, self.job, iterator, self.trace)
        return AmqpCommitMessage(
            result.partition, result.rows, result.seconds, self.job, result.publisher
        )

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Log the totals of the write (on the driver, once every task succeeded)."""
        driver_log().info("amqp: %s", commit_totals(messages, self.job))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Log what was confirmed before the write failed (those rows stay published)."""
        driver_log().warning(
            "amqp: write %s failed: %s (at least once: a rerun with the same id_prefix "
            "republishes the same message ids)",
            self.job,
            commit_totals(messages, self.job),
        )


class AmqpStreamWriter(DataSourceStreamArrowWriter):
    """Writes micro-batches: ids are ``f"{query}:b{batch}:{partition}:{position}"``.

    ``query`` is ``id_prefix`` if given, else the streaming query id (kept in the checkpoint, so a
    batch replayed after a restart republishes the same ids).
    """

    def __init__(self, config: SinkConfig, plan: ColumnPlan, fallback: str) -> None:
        self.config = config
        self.plan = plan
        self.fallback = fallback

    def _job(self) -> str:
        ctx = TaskContext.get()
        query = self.config.id_prefix
        batch = None
        if ctx is not None:
            query = query or ctx.getLocalProperty(_STREAM_QUERY_ID)
            batch = ctx.getLocalProperty(_STREAM_BATCH_ID)
        if batch is None:  # not seen with Spark 4, but never derive ids from nothing
            stage = ctx.stageId() if ctx is not None else 0
            return f"{query or self.fallback}:s{stage}"
        return f"{query or self.fallback}:b{batch}"

    def write(self, iterator: Iterator[Any]) -> AmqpCommitMessage:
        """Publish one partition of a micro-batch; return its counts."""
        job = self._job()
        result = publish_arrow(self.config, self.plan, job, iterator)
        return AmqpCommitMessage(
            result.partition, result.rows, result.seconds, job, result.publisher
        )

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Log the micro-batch's totals."""
        jobs = {m.job for m in messages if isinstance(m, AmqpCommitMessage)}
        driver_log().info(
            "amqp: micro-batch %d: %s", batchId, commit_totals(messages, "/".join(jobs))
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Log a failed micro-batch (Spark replays it with the same batch id and message ids)."""
        jobs = {m.job for m in messages if isinstance(m, AmqpCommitMessage)}
        driver_log().warning(
            "amqp: micro-batch %d failed; %s; Spark replays it with the same ids",
            batchId,
            commit_totals(messages, "/".join(jobs) or "?"),
        )


def register(spark: SparkSession) -> None:
    """Register the ``"amqp"`` format, for writing and reading, with a SparkSession (once per
    session).

    Raises :class:`ConfigurationError` when the session's Python workers run on this machine in
    an interpreter that cannot import ``reliable_amqp`` (``PYSPARK_PYTHON``: see docs/spark.md).
    """
    check_workers(spark)
    spark.dataSource.register(AmqpDataSource)
