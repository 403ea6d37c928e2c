"""A task Spark is done with stops handing rows to the publisher.

The sign a Python worker gets is its executor closing the connection the task came in on
(``TaskLink``). Inside real Spark tasks the link must be found (else the check is dead code);
the stop itself is driven here by closing the peer of a socket pair standing in for that
connection, under a frame of a ``pyspark.*`` module as in a worker, with the real broker.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.cloudpickle import register_pickle_by_value
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

from reliable_amqp.spark import SinkConfig, TaskInterrupted, close_cached_publishers
from reliable_amqp.spark._interrupt import TaskLink
from reliable_amqp.spark._mapping import Chunk
from reliable_amqp.spark._publish import SLICE, publish_partition
from support.spark import unique_name

# Workers cannot import this test module: ship its classes (the probe data source) by value.
register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]

_WORKER_FRAME = '''
def main(infile, run):
    """Stands for pyspark.worker.main(infile, outfile): the task runs below this frame."""
    return run()
'''


def in_worker_frame(infile: Any, run: Any) -> Any:
    """Call ``run`` below a frame of a module named like PySpark's worker, holding ``infile``."""
    namespace: dict[str, Any] = {"__name__": "pyspark.worker_stand_in"}
    exec(compile(_WORKER_FRAME, "<pyspark.worker stand-in>", "exec"), namespace)
    return namespace["main"](infile, run)


def test_the_link_is_ended_once_the_executor_side_closes() -> None:
    ours, executor = socket.socketpair()
    with ours, ours.makefile("rb") as infile:
        link = in_worker_frame(infile, TaskLink)
        assert link.watched and not link.ended()
        executor.sendall(b"rows still buffered")  # data waiting is not an end
        assert not link.ended()
        executor.close()
        assert link.ended()
    assert not TaskLink().watched  # outside a worker: nothing to watch, never ended


@pytest.mark.broker
def test_publishing_stops_within_a_slice_when_the_task_ends(broker: Any, amqp_url: str) -> None:
    queue = broker.queue(unique_name("interrupt"))
    config = SinkConfig.from_strings(
        {"url": amqp_url, "routing_key": queue, "max_in_flight": "200"}
    )
    ours, executor = socket.socketpair()
    chunk_rows = 2 * SLICE

    def chunks() -> Iterator[Chunk]:
        for n in range(50):
            if n == 3:
                executor.close()  # Spark gives up on the task while it reads its rows
            yield Chunk(chunk_rows, [b"x" * 100] * chunk_rows, None, None, None, [])

    try:
        with ours, ours.makefile("rb") as infile, pytest.raises(TaskInterrupted) as stopped:
            in_worker_frame(infile, lambda: publish_partition(config, chunks(), "job:0", 0))
        handed = stopped.value.handed
        print(f"stopped after handing {handed} of {50 * chunk_rows} rows to the publisher")
        assert handed == 3 * chunk_rows  # the first look after the hang-up stops it
    finally:
        close_cached_publishers()  # closing flushes: what was handed over is delivered
    assert broker.count(queue) == handed


@pytest.mark.spark
def test_tasks_find_their_link(spark: SparkSession) -> None:
    """In real tasks (Arrow batches and Row objects) the link is found and open."""

    def arrow(batches: Iterator[Any]) -> Iterator[Any]:
        link = TaskLink()
        for _ in batches:
            pass
        yield pa.record_batch(
            [pa.array([link.watched]), pa.array([link.ended()])], names=["watched", "ended"]
        )

    df = spark.range(0, 1000, numPartitions=2)
    found = df.mapInArrow(arrow, "watched boolean, ended boolean").collect()
    assert [(r.watched, r.ended) for r in found] == [(True, False)] * 2
    if not hasattr(df, "rdd"):
        return

    def rows(items: Iterable[Any]) -> Iterator[tuple[bool, bool]]:
        link = TaskLink()
        for _ in items:
            pass
        yield (link.watched, link.ended())

    assert df.rdd.mapPartitions(rows).collect() == [(True, False)] * 2


@dataclass
class _Found(WriterCommitMessage):
    watched: bool
    ended: bool


class _LinkProbe(DataSource):
    """A data source whose tasks report whether they find their link (as the amqp one's do)."""

    @classmethod
    def name(cls) -> str:
        return "reliable_amqp_link_probe"

    def writer(self, schema: Any, overwrite: bool) -> _LinkProbeWriter:
        return _LinkProbeWriter(self.options["out"])


class _LinkProbeWriter(DataSourceArrowWriter):
    def __init__(self, out: str) -> None:
        self.out = out

    def write(self, iterator: Iterator[Any]) -> _Found:
        link = TaskLink()
        for _ in iterator:
            pass
        return _Found(link.watched, link.ended())

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        found = [[m.watched, m.ended] for m in messages if isinstance(m, _Found)]
        Path(self.out).write_text(json.dumps(found))


@pytest.mark.spark
def test_data_source_tasks_find_their_link(spark: SparkSession, tmp_path: Path) -> None:
    spark.dataSource.register(_LinkProbe)
    out = tmp_path / "found.json"
    spark.range(0, 1000, numPartitions=2).write.format("reliable_amqp_link_probe").mode(
        "append"
    ).option("out", str(out)).save()
    assert json.loads(out.read_text()) == [[True, False]] * 2
