"""Totals the driver sees: foreachPartition through an accumulator (classic sessions; None
through Connect), the data source's commit and abort; provider objects are refused."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from reliable_amqp import ConfigurationError
from reliable_amqp.spark import AmqpCommitMessage, AmqpSink, SinkTotals
from reliable_amqp.spark._datasource import AmqpBatchWriter, AmqpStreamWriter
from reliable_amqp.spark._sink import is_connect
from support.spark import unique_name

pytestmark = [pytest.mark.spark, pytest.mark.broker]


@pytest.mark.spark_connect
def test_foreach_partition_totals_reach_the_driver(
    spark: SparkSession, broker: Any, amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue = broker.queue(unique_name("totals"))
    sink = AmqpSink(amqp_url, routing_key=queue)
    df = spark.range(0, 300, numPartitions=3).select(F.col("id").cast("string").alias("body"))
    with caplog.at_level(logging.INFO, logger="reliable_amqp.spark"):
        df.foreachPartition(sink)
        df.limit(100).repartition(1).foreachPartition(sink)
    assert broker.count(queue) == 400
    if is_connect(df):
        assert sink.totals is None  # Connect has no accumulators
        return
    assert sink.totals == SinkTotals(rows=400, partitions=4)
    merged = [r.getMessage() for r in caplog.records if "foreachPartition" in r.getMessage()]
    assert len(merged) == 4, merged
    assert merged[-1].endswith("this sink so far: 400 rows confirmed from 4 partitions")


def test_a_sink_made_before_the_session_gets_its_accumulator_when_shipped(
    spark: SparkSession, broker: Any, amqp_url: str
) -> None:
    queue = broker.queue(unique_name("late"))
    sink = AmqpSink(amqp_url, routing_key=queue)
    sink._totals = None  # as if built before the SparkContext existed
    spark.range(0, 10, numPartitions=2).select(
        F.col("id").cast("string").alias("body")
    ).foreachPartition(sink)
    assert sink.totals == SinkTotals(rows=10, partitions=2)


def test_provider_objects_are_refused_by_the_sink(amqp_url: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    with pytest.raises(ConfigurationError, match="tracer_provider cannot be used with"):
        AmqpSink(amqp_url, routing_key="q", tracer_provider=TracerProvider())


def _writer(amqp_url: str) -> AmqpBatchWriter:
    from reliable_amqp.spark import SinkConfig

    config = SinkConfig.from_strings({"url": amqp_url, "routing_key": "q"})
    return AmqpBatchWriter(config, None, "job-1")  # type: ignore[arg-type]


def test_commit_and_abort_log_confirmed_and_failed_partitions(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = _writer(amqp_url)
    done = [AmqpCommitMessage(0, 500, 0.1, "job-1", "1:1"), AmqpCommitMessage(1, 250, 0.1, "job-1")]
    with caplog.at_level(logging.INFO, logger="reliable_amqp.spark"):
        writer.commit(list(done))
        writer.abort([done[0], None, None])
    assert caplog.messages[0] == (
        "amqp: 750 rows confirmed from 2 partitions (ids job-1:*; 2 cached publishers)"
    )
    assert caplog.messages[1].startswith(
        "amqp: write job-1 failed: 500 rows confirmed from 1 partition (ids job-1:*; 1 cached "
        "publisher); 2 partitions failed (at least once"
    )
    stream = AmqpStreamWriter(writer.config, writer.plan, "fallback")
    with caplog.at_level(logging.INFO, logger="reliable_amqp.spark"):
        stream.abort([None, done[1]], 7)
    assert "micro-batch 7 failed; 250 rows confirmed from 1 partition" in caplog.messages[-1]
    assert "1 partition failed" in caplog.messages[-1]


_TRACE_SCRIPT = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pyspark.sql import Row

from reliable_amqp.spark import SinkConfig, close_cached_publishers, publish_partition
from reliable_amqp.spark._publish import chunk_rows
from reliable_amqp.spark._trace import capture

spans = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(provider)
config = SinkConfig.from_strings({"url": sys.argv[1], "routing_key": sys.argv[2]})
with trace.get_tracer("driver").start_as_current_span("nightly-export") as driver:
    carrier = capture(config.publisher)  # on the driver, as the sink does
assert carrier and "traceparent" in carrier, carrier
# in a task: no current span, the driver's context arrives with the job
rows = [Row(body="row %d" % i) for i in range(3)]
result = publish_partition(config, chunk_rows(None, config, rows), "job:0", 0, carrier)
assert result.rows == 3
close_cached_publishers()
producers = [s for s in spans.get_finished_spans() if s.kind is trace.SpanKind.PRODUCER]
assert len(producers) == 3, producers
for span in producers:
    assert span.parent.span_id == driver.get_span_context().span_id
    assert span.context.trace_id == driver.get_span_context().trace_id
print("ok")
"""


def test_the_drivers_trace_context_is_the_tasks_parent(broker: Any, amqp_url: str) -> None:
    """What a task does with the carrier the driver captured (no Spark job: the executors of
    the shared session have no SDK, and the global providers can only be set once)."""
    import subprocess
    import sys

    queue = broker.queue(unique_name("trace"))
    result = subprocess.run(
        [sys.executable, "-c", _TRACE_SCRIPT, amqp_url, queue],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-4000:]
    assert broker.count(queue) == 3
