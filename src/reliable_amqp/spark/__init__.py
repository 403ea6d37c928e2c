"""PySpark integration: write DataFrames through the confirming publisher, at least once.

Installed with the ``spark`` extra (in a checkout: ``pip install '.[spark]'``). Three entry points
share one partition-publishing function:

- :class:`AmqpSink`: ``df.foreachPartition(sink)``, ``sink.write(df)`` (Arrow batches, returns
  totals) and ``writeStream.foreachBatch(sink.for_batch)``;
- :class:`AmqpDataSource`, format ``"amqp"`` (``register(spark)`` first):
  ``df.write.format("amqp").mode("append").option("url", ...).save()`` and
  ``df.writeStream.format("amqp")``; and, for streams (RabbitMQ, LavinMQ),
  ``spark.read.format("amqp")`` and ``spark.readStream.format("amqp")``, exactly once into
  checkpointed sinks (:class:`AmqpStreamReader`).

A task whose rows are not all confirmed raises :class:`RowsNotConfirmed` (Spark retries it where it
retries tasks, not under a ``local[N]`` master, and a retry republishes the same message ids).
See ``docs/spark.md``.
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
    from pyspark.sql.datasource import DataSource  # noqa: F401  (PySpark >= 4)
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "reliable_amqp.spark needs PySpark 4 and PyArrow: "
        "install the 'spark' extra (in a checkout: pip install '.[spark]')"
    ) from exc

from reliable_amqp.spark._cache import close_cached_publishers
from reliable_amqp.spark._datasource import (
    AmqpBatchWriter,
    AmqpCommitMessage,
    AmqpDataSource,
    AmqpStreamWriter,
    CommitTotals,
    register,
)
from reliable_amqp.spark._interrupt import TaskInterrupted
from reliable_amqp.spark._mapping import KNOWN_COLUMNS, ColumnPlan
from reliable_amqp.spark._publish import (
    PartitionResult,
    RowsNotConfirmed,
    SinkConfig,
    publish_partition,
)
from reliable_amqp.spark._read import AmqpBatchReader, AmqpStreamReader
from reliable_amqp.spark._read_options import ReadConfig
from reliable_amqp.spark._sink import AmqpSink, WriteSummary
from reliable_amqp.spark._stream import (
    NotAStream,
    StreamDataLost,
    StreamNotFound,
    StreamReadStalled,
    StreamUnavailable,
)
from reliable_amqp.spark._totals import SinkTotals

__all__ = [
    "KNOWN_COLUMNS",
    "AmqpBatchReader",
    "AmqpBatchWriter",
    "AmqpCommitMessage",
    "AmqpDataSource",
    "AmqpSink",
    "AmqpStreamReader",
    "AmqpStreamWriter",
    "ColumnPlan",
    "CommitTotals",
    "NotAStream",
    "PartitionResult",
    "ReadConfig",
    "RowsNotConfirmed",
    "SinkConfig",
    "SinkTotals",
    "StreamDataLost",
    "StreamNotFound",
    "StreamReadStalled",
    "StreamUnavailable",
    "TaskInterrupted",
    "WriteSummary",
    "close_cached_publishers",
    "publish_partition",
    "register",
]
