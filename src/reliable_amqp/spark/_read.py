"""Reading streams with the ``"amqp"`` data source: ``spark.read`` and ``spark.readStream``.

An offset, for Spark, is a dict ``{stream: next offset to read}`` (one key per partition stream of
a super stream). Each micro-batch is the range ``[start, end)`` of every stream, fixed on the
driver before any task runs and kept in the query's checkpoint; a task reads exactly its range,
so a replay (after a driver restart, a lost executor, a retried task) reads the same messages.
``-1`` stands for "the stream's first offset" while a stream is empty (RabbitMQ starts counting at
0, LavinMQ at 1, and an empty stream does not say which).

The driver side (offsets, planning) runs in a Python worker Spark starts on the driver; tasks run
:func:`read_partition` in executors' Python workers. Both reach the broker through
:mod:`reliable_amqp.spark._stream`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from reliable_amqp._core.delivery import Delivery
from reliable_amqp.spark._plan import (
    FIRST,
    Offsets,
    batch_range,
    check_heads,
    checked_start,
    confirmed_end,
    lost_everything,
)
from reliable_amqp.spark._read_options import ReadConfig
from reliable_amqp.spark._stream import (
    OFFSET_HEADER,
    end_offset,
    first_offset,
    lowest_offset,
    read_range,
)

log = logging.getLogger("reliable_amqp.spark")

#: the columns of a read, in order (Kafka's shape for ``headers``)
READ_SCHEMA_DDL = (
    "value binary, message_id string, stream string, offset long, routing_key string, "
    "exchange string, timestamp timestamp, headers array<struct<key:string,value:binary>>, "
    "content_type string, correlation_id string, type string"
)
_ROWS_PER_BATCH = 5000


def read_schema() -> StructType:
    """The schema of a read (see :data:`READ_SCHEMA_DDL`; built without a SparkSession)."""
    header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
    return StructType(
        [
            StructField("value", BinaryType()),
            StructField("message_id", StringType()),
            StructField("stream", StringType()),
            StructField("offset", LongType()),
            StructField("routing_key", StringType()),
            StructField("exchange", StringType()),
            StructField("timestamp", TimestampType()),
            StructField("headers", ArrayType(header)),
            StructField("content_type", StringType()),
            StructField("correlation_id", StringType()),
            StructField("type", StringType()),
        ]
    )


@dataclass
class StreamRange(InputPartition):
    """One task's work: offsets ``[start, end)`` of one stream."""

    stream: str
    start: int
    end: int
    #: the config travels with the partition: read() must not depend on reader state
    config: ReadConfig = field(repr=False)

    def __post_init__(self) -> None:
        InputPartition.__init__(self, (self.stream, self.start, self.end))


def split(config: ReadConfig, start: Offsets, end: Offsets) -> list[StreamRange]:
    """Cut each stream's range into pieces: ``minPartitions`` pieces in all, shared between the
    streams by their sizes, at least one per stream with messages to read."""
    sizes = {s: end[s] - start[s] for s in end if end[s] > start[s]}
    total = sum(sizes.values())
    out: list[StreamRange] = []
    for stream, size in sizes.items():
        pieces = max(1, min(size, math.floor(config.min_partitions * size / total + 0.5)))
        step = size / pieces
        bounds = [start[stream] + round(step * i) for i in range(pieces)] + [end[stream]]
        out += [
            StreamRange(stream, bounds[i], bounds[i + 1], config)
            for i in range(pieces)
            if bounds[i + 1] > bounds[i]
        ]
    return out


# --- rows -----------------------------------------------------------------------------------

_ARROW = to_arrow_schema(read_schema(), timezone="UTC")


def _header_bytes(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str, sort_keys=True).encode()
    if isinstance(value, bool):
        return b"true" if value else b"false"
    return str(value).encode()


def _headers(headers: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not headers or (len(headers) == 1 and OFFSET_HEADER in headers):
        return []  # (most messages: the stream's offset is their only header)
    return [
        {"key": str(k), "value": _header_bytes(v)} for k, v in headers.items() if k != OFFSET_HEADER
    ]


def to_batch(stream: str, offsets: Sequence[int], deliveries: Sequence[Delivery]) -> pa.RecordBatch:
    """One Arrow record batch of the read's schema (column by column: this runs per message)."""
    columns: dict[str, list[Any]] = {
        "value": [d.body for d in deliveries],
        "message_id": [d.message_id for d in deliveries],
        "stream": [stream] * len(deliveries),
        "offset": list(offsets),
        "routing_key": [d.routing_key for d in deliveries],
        "exchange": [d.exchange for d in deliveries],
        "timestamp": [None if (t := d.timestamp) is None else t * 1_000_000 for d in deliveries],
        "headers": [_headers(d.headers) for d in deliveries],
        "content_type": [d.content_type for d in deliveries],
        "correlation_id": [d.correlation_id for d in deliveries],
        "type": [d.type for d in deliveries],
    }
    arrays = [pa.array(columns[f.name], type=f.type) for f in _ARROW]
    return pa.RecordBatch.from_arrays(arrays, schema=_ARROW)


def read_partition(part: StreamRange) -> Iterator[pa.RecordBatch]:
    """A task's read: its range, as Arrow record batches."""
    config = part.config
    started = time.monotonic()
    count = size = 0
    offsets: list[int] = []
    deliveries: list[Delivery] = []
    for chunk in read_range(
        config.connector,
        part.stream,
        part.start,
        part.end,
        prefetch=config.prefetch,
        fail_on_data_loss=config.fail_on_data_loss,
    ):
        offsets += chunk.offsets
        deliveries += chunk.deliveries
        if len(offsets) >= _ROWS_PER_BATCH:
            count += len(offsets)
            size += sum(len(d.body) for d in deliveries)
            yield to_batch(part.stream, offsets, deliveries)
            offsets, deliveries = [], []
    if offsets:
        count += len(offsets)
        size += sum(len(d.body) for d in deliveries)
        yield to_batch(part.stream, offsets, deliveries)
    log.info(
        "amqp: read %d messages (%d body bytes) of stream %r, offsets %d..%d, in %.2f s",
        count,
        size,
        part.stream,
        part.start,
        part.end - 1,
        time.monotonic() - started,
    )


# --- Spark's reader classes -----------------------------------------------------------------


class AmqpBatchReader(DataSourceReader):
    """``spark.read.format("amqp")``: the range from ``startingOffsets`` (default ``earliest``)
    to ``endingOffsets`` (default ``latest``: the stream's end when the read is planned)."""

    def __init__(self, config: ReadConfig) -> None:
        self.config = config
        self.names = config.streams()

    def partitions(self) -> Sequence[InputPartition]:
        """Fix every stream's range (on the driver) and split it."""

        def ranges(connection: Any) -> tuple[Offsets, Offsets]:
            lowest = lowest_offset(connection)
            start: Offsets = {}
            end: Offsets = {}
            for s in self.names:
                start[s], end[s] = batch_range(self.config, s, connection, lowest)
            return check_heads(self.config, start, end, connection), end

        start, end = self.config.connector.probing(ranges)
        parts = split(self.config, start, end)
        return parts or [StreamRange(self.names[0], 0, 0, self.config)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Read one range."""
        assert isinstance(partition, StreamRange)
        return read_partition(partition)


class AmqpStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("amqp")``: micro-batches of offset ranges."""

    def __init__(self, config: ReadConfig) -> None:
        self.config = config
        self.names = config.streams()
        self.latest: Offsets | None = None
        self.target: Offsets | None = None
        self.lowest = 0  # (the broker's lowest stream offset: set by each probe of the ends)
        #: (stream, offset) pairs whose loss (an emptied stream) was warned of already
        self.told: set[tuple[str, int]] = set()

    def initialOffset(self) -> dict[str, int]:
        """Where a new query starts (``startingOffsets``; default ``latest``); an offset past
        the stream's end fails, one in an emptied stream is a loss (see ``_plan``)."""

        def starts(connection: Any) -> Offsets:
            lowest = lowest_offset(connection)
            return {
                s: checked_start(self.config, s, connection, lowest, self.told) for s in self.names
            }

        return self.config.connector.probing(starts)

    def _ends(self) -> Offsets:
        def ends(connection: Any) -> Offsets:
            self.lowest = lowest_offset(connection)
            found = {s: end_offset(connection, s) for s in self.names}
            return {s: FIRST if e is None else e for s, e in found.items()}

        return self.config.connector.probing(ends)

    def _emptied(self, begin: Offsets, ends: Offsets) -> None:
        """Streams that answered "empty" while the query is past their lowest offset (the
        checkpoint remembers offsets they held): look again, and where they are empty, that
        is a loss (raised, or warned of once); where they are not, take the end found."""
        suspects = [
            s
            for s in self.names
            if ends[s] == FIRST
            and begin[s] > self.lowest  # (FIRST is below it)
            and (s, begin[s]) not in self.told
        ]
        if not suspects:
            return
        found = self.config.connector.probing(
            lambda connection: {s: confirmed_end(connection, s) for s in suspects}
        )
        for s, tail in found.items():
            if tail is not None:
                ends[s] = tail
                continue
            lost_everything(self.config, s, begin[s])
            self.told.add((s, begin[s]))

    def getDefaultReadLimit(self) -> ReadLimit:
        """``maxMessagesPerTrigger`` when given."""
        if self.config.max_per_trigger is not None:
            return ReadMaxRows(self.config.max_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """``trigger(availableNow=True)``: read up to the streams' ends as they are now."""
        self.target = self._ends()

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """The next micro-batch's end: the streams' ends, cut to the read limit."""
        ends = self._ends()
        self.latest = dict(ends)
        if self.target is not None:
            ends = {s: min(e, self.target.get(s, e)) for s, e in ends.items()}
        begin = {s: int(start.get(s, FIRST)) for s in self.names}
        self._emptied(begin, ends)
        if any(b == FIRST for b in begin.values()):

            def firsts(connection: Any) -> Offsets:
                found = {
                    s: first_offset(connection, s, held=True)
                    for s, b in begin.items()
                    if b == FIRST and ends[s] != FIRST  # (an empty stream: no probe)
                }
                return {s: ends[s] if f is None else f for s, f in found.items()}

            begin.update(self.config.connector.probing(firsts))
        avail = {s: max(0, ends[s] - begin[s]) for s in self.names}
        total = sum(avail.values())
        cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        if cap is not None and total > cap:
            share = {s: cap * a // total for s, a in avail.items()}
            spare = cap - sum(share.values())
            for s in sorted(avail, key=lambda k: -avail[k]):
                if spare and share[s] < avail[s]:
                    share[s] += 1
                    spare -= 1
            avail = share
        out = {}
        for s in self.names:
            old = int(start.get(s, FIRST))
            out[s] = old if avail[s] == 0 else begin[s] + avail[s]
        log.debug("amqp: latest offsets %s (stream ends %s)", out, self.latest)
        return out

    def reportLatestOffset(self) -> dict[str, int] | None:
        """The streams' ends at the last look: the query's progress shows the lag behind them."""
        return self.latest

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        """The micro-batch's ranges (checked against retention), split."""
        begin = {s: int(start.get(s, FIRST)) for s in end}
        stop = {s: int(v) for s, v in end.items()}
        begin = self.config.connector.probing(
            lambda connection: check_heads(self.config, begin, stop, connection)
        )
        parts = split(self.config, begin, stop)
        log.debug("amqp: micro-batch %s..%s in %d partitions", begin, stop, len(parts))
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Read one range."""
        assert isinstance(partition, StreamRange)
        return read_partition(partition)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: the offsets live in Spark's checkpoint, not on the broker."""
