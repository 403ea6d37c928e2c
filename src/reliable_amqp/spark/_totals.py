"""Totals of ``df.foreachPartition(sink)`` on the driver, through a Spark accumulator.

Each task that succeeds adds ``(rows, 1)``; the driver merges the updates as tasks finish and
logs each at INFO (``reliable_amqp.spark``), so the totals show without a driver-side call.
Spark drops the accumulator updates of a task attempt that fails (PySpark's workers send them
only after the task's function returned), so rows that failed are never in these totals: they
are in the task's :class:`~reliable_amqp.spark.RowsNotConfirmed`, which Spark logs for each
failed attempt and raises from the job once a partition's attempts are spent.

Spark Connect has no accumulators: there, ``sink.totals`` is None and the totals come from
``sink.write(df, via="rows")`` (the same Row path) or the data source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.accumulators import AccumulatorParam

log = logging.getLogger("reliable_amqp.spark")


@dataclass(frozen=True, slots=True)
class SinkTotals:
    """What the tasks of a sink's ``foreachPartition`` jobs confirmed (successful tasks only)."""

    #: rows confirmed by the broker
    rows: int = 0
    #: tasks (partitions) that succeeded
    partitions: int = 0

    def __add__(self, other: SinkTotals) -> SinkTotals:
        return SinkTotals(self.rows + other.rows, self.partitions + other.partitions)

    def __str__(self) -> str:
        return (
            f"{self.rows} rows confirmed from {self.partitions} "
            f"partition{'' if self.partitions == 1 else 's'}"
        )


class TotalsParam(AccumulatorParam[SinkTotals]):
    """Adds :class:`SinkTotals`; on the driver, logs each task's update as it is merged."""

    def zero(self, value: SinkTotals) -> SinkTotals:
        """No rows, no partitions."""
        return SinkTotals()

    def addInPlace(self, value1: SinkTotals, value2: SinkTotals) -> SinkTotals:
        """The sum; logged when merged on the driver (where there is no task context)."""
        total = value1 + value2
        if value2.partitions and TaskContext.get() is None:
            log.info(
                "amqp: foreachPartition: a task confirmed %d rows; this sink so far: %s",
                value2.rows,
                total,
            )
        return total


def driver_accumulator() -> Any:
    """An accumulator of :class:`SinkTotals` on the active classic SparkContext, else None
    (on an executor, through Spark Connect, or before any session exists)."""
    if TaskContext.get() is not None:
        return None
    from pyspark import SparkContext
    from pyspark.sql.utils import is_remote

    if is_remote():  # a Connect client (its tasks report to the server, never here)
        return None

    context = SparkContext._active_spark_context
    if context is None:
        return None
    return context.accumulator(SinkTotals(), TotalsParam())
