"""Which column becomes which part of a message, checked against a schema before anything is sent.

A :class:`ColumnPlan` is built once on the driver from a DataFrame's schema (or, for
``df.foreachPartition(sink)``, from the first row a task sees) and shipped to the executors. There
it turns a chunk of rows, an Arrow ``RecordBatch`` or a list of ``Row`` objects, into a
:class:`Chunk`: one Python list per message part, ready for ``Publisher.publish``.

Column mapping (names are exact; the body and routing key columns may be renamed by option; a
``value`` column is the body when there is no ``body`` column, as in Spark's Kafka sink):

========================  ==========================================================  =========
column                    Spark type                                                  becomes
========================  ==========================================================  =========
``body``                  binary (as is), string (UTF-8), anything else (JSON)        body
``exchange``              string                                                      exchange
``routing_key``           string                                                      routing key
``headers``               map<string, string|int|long|double|boolean|binary|...>      headers
``message_id`` ...        string (see :data:`STRING_PROPERTIES`)                      property
``priority``              byte, short, int, long (0-255)                              property
``delivery_mode``         byte, short, int, long (1 or 2)                             property
``expiration``            string or integer (milliseconds)                            property
``timestamp``             timestamp, timestamp_ntz, or integer POSIX seconds          property
========================  ==========================================================  =========
"""

from __future__ import annotations

import base64
import calendar
import datetime as _dt
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from reliable_amqp import ConfigurationError

#: AMQP basic properties that come from string columns of the same name.
STRING_PROPERTIES: tuple[str, ...] = (
    "message_id",
    "correlation_id",
    "content_type",
    "content_encoding",
    "type",
    "app_id",
    "user_id",
    "reply_to",
)
_INT_PROPERTIES = ("priority", "delivery_mode")
_INTEGER_TYPES = (ByteType, ShortType, IntegerType, LongType)
_HEADER_VALUE_TYPES = (
    StringType,
    BinaryType,
    BooleanType,
    ByteType,
    ShortType,
    IntegerType,
    LongType,
    FloatType,
    DoubleType,
    DecimalType,
    TimestampType,
)
#: Every column name the sink knows besides the body and routing key columns.
KNOWN_COLUMNS: tuple[str, ...] = (
    "exchange",
    "headers",
    *STRING_PROPERTIES,
    *_INT_PROPERTIES,
    "expiration",
    "timestamp",
)

#: Spark's Kafka sink takes the payload from ``value``: it is the body when the DataFrame has no
#: ``body`` column and ``body_column`` is left at its default.
KAFKA_VALUE = "value"
#: Kafka sink columns that have no column of the same name here, and what to use instead.
_KAFKA_HINTS: dict[str, str] = {
    "key": "Kafka's key: alias it routing_key (topic or direct exchange) or message_id",
    "topic": "Kafka's topic: alias it routing_key (default exchange: the queue) or exchange",
    "partition": "Kafka's partition has no AMQP counterpart: drop it",
}


def body_column_for(names: Sequence[str], body_column: str) -> str:
    """The body column of a DataFrame with columns ``names``: ``body_column``, or Kafka's
    ``value`` when the body column is left at ``"body"`` and there is none of that name."""
    if body_column == "body" and "body" not in names and KAFKA_VALUE in names:
        return KAFKA_VALUE
    return body_column


def _unknown(name: str) -> str:
    hint = _KAFKA_HINTS.get(name)
    return f"unknown column {name!r}" + (f" ({hint})" if hint else "")


# How a column's values are converted (set from its Spark type on the driver).
AS_IS = "as_is"  # already what publish() takes
UTF8 = "utf8"  # str -> bytes
JSON = "json"  # any value -> JSON bytes
TO_STR = "to_str"  # integer -> str (expiration)
MAP = "map"  # map -> dict (headers)
TS_LOCAL = "ts_local"  # timestamp with time zone -> POSIX seconds
TS_NTZ = "ts_ntz"  # timestamp without time zone (wall clock taken as UTC) -> POSIX seconds
AUTO = "auto"  # no schema (foreachPartition): decided per value


@dataclass(frozen=True, slots=True)
class Column:
    """One mapped column: where it is in a row, what it becomes and how it is converted."""

    name: str
    index: int
    role: str  # "body", "exchange", "routing_key", "headers" or a property name
    kind: str
    #: the column's Spark type (None when planned from a Row): drives JSON conversion
    data_type: DataType | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk of rows as lists of message parts (``None`` where a row has no value)."""

    size: int
    bodies: list[Any]  # bytes, bytearray (Row path) or None
    exchanges: list[str | None] | None
    routing_keys: list[str | None] | None
    message_ids: list[str | None] | None
    #: (property name, values): headers, correlation_id, priority, ...
    properties: list[tuple[str, list[Any]]]


@dataclass(frozen=True, slots=True)
class ColumnPlan:
    """The mapped columns of a schema; picklable, built on the driver."""

    columns: tuple[Column, ...]
    width: int
    default_content_type: str | None = None

    def role(self, role: str) -> Column | None:
        """The column playing ``role``, if any."""
        for column in self.columns:
            if column.role == role:
                return column
        return None

    # --- executors --------------------------------------------------------------------------

    def chunk_from_arrow(self, batch: Any) -> Chunk:
        """Convert a ``pyarrow.RecordBatch`` (columns in schema order)."""
        lists: dict[str, list[Any]] = {}
        for column in self.columns:
            lists[column.role] = _arrow_values(batch.column(column.index), column)
        return self._chunk(batch.num_rows, lists)

    def chunk_from_rows(self, rows: Sequence[Sequence[Any]]) -> Chunk:
        """Convert a list of ``Row`` objects (or tuples in schema order)."""
        lists: dict[str, list[Any]] = {}
        for column in self.columns:
            values = [row[column.index] for row in rows]
            lists[column.role] = _row_values(values, column)
        return self._chunk(len(rows), lists)

    def _chunk(self, size: int, lists: dict[str, list[Any]]) -> Chunk:
        bodies = lists.pop("body")
        exchanges = lists.pop("exchange", None)
        routing_keys = lists.pop("routing_key", None)
        message_ids = lists.pop("message_id", None)
        if self.default_content_type is not None:
            given = lists.get("content_type")
            lists["content_type"] = (
                [self.default_content_type] * size
                if given is None
                else [v if v is not None else self.default_content_type for v in given]
            )
        return Chunk(size, bodies, exchanges, routing_keys, message_ids, list(lists.items()))


# --- planning (driver) ---------------------------------------------------------------------------


def plan_for_schema(
    schema: StructType, body_column: str, routing_key_column: str, *, has_routing_key: bool
) -> ColumnPlan:
    """Check a DataFrame schema and plan its columns; raise ConfigurationError naming every
    unknown column and every wrong type at once."""
    problems: list[str] = []
    columns: list[Column] = []
    names = [f.name for f in schema.fields]
    body_column = body_column_for(names, body_column)
    for index, field in enumerate(schema.fields):
        role = _role_of(field.name, body_column, routing_key_column)
        if role is None:
            problems.append(_unknown(field.name))
            continue
        kind = _kind_for_type(role, field.dataType)
        if kind is None:
            kafka = role == "headers" and isinstance(field.dataType, ArrayType)
            problems.append(
                f"column {field.name!r} ({role}) has type {field.dataType.simpleString()}; "
                f"expected {_EXPECTED[_expected_key(role)]}"
                + (" (Kafka-style headers: F.map_from_entries('headers'))" if kafka else "")
            )
            continue
        columns.append(Column(field.name, index, role, kind, field.dataType))
    return _finish(
        columns, names, problems, body_column, routing_key_column, has_routing_key=has_routing_key
    )


def plan_for_row(
    row: Any, body_column: str, routing_key_column: str, *, has_routing_key: bool
) -> ColumnPlan:
    """Plan from the first ``Row`` of a partition (``df.foreachPartition(sink)``: no schema).

    Names are checked as for a schema; types are checked on this row's non-null values.
    """
    fields = getattr(row, "__fields__", None)
    if fields is None:
        raise ConfigurationError(
            f"AmqpSink expects pyspark Row objects with named fields, got {type(row).__name__}"
        )
    problems: list[str] = []
    columns: list[Column] = []
    body_column = body_column_for(list(fields), body_column)
    for index, name in enumerate(fields):
        role = _role_of(name, body_column, routing_key_column)
        if role is None:
            problems.append(_unknown(name))
            continue
        value = row[index]
        if value is not None and not _value_fits(role, value):
            problems.append(
                f"column {name!r} ({role}) holds a {type(value).__name__}; "
                f"expected {_EXPECTED[_expected_key(role)]}"
            )
            continue
        kind = _kind_for_value(role, value)
        columns.append(Column(name, index, role, kind, None))
    return _finish(
        columns,
        list(fields),
        problems,
        body_column,
        routing_key_column,
        has_routing_key=has_routing_key,
    )


def _finish(
    columns: list[Column],
    names: list[str],
    problems: list[str],
    body_column: str,
    routing_key_column: str,
    *,
    has_routing_key: bool,
) -> ColumnPlan:
    if body_column not in names:
        kafka = f"nor Kafka's {KAFKA_VALUE!r}; " if body_column == "body" else ""
        problems.append(f"no body column {body_column!r} ({kafka}set body_column= to use another)")
    if not has_routing_key and routing_key_column not in names:
        problems.append(
            f"no routing key: give routing_key= or a {routing_key_column!r} column "
            "(for the default exchange the routing key is the queue name)"
        )
    if problems:
        known = ", ".join([body_column, routing_key_column, *KNOWN_COLUMNS])
        raise ConfigurationError(
            "cannot publish this DataFrame: "
            + "; ".join(problems)
            + f". Known columns: {known}. Select, rename or cast columns first, e.g. "
            "df.select(F.col('payload').alias('body'), ...); nothing was sent."
        )
    json_body = any(c.role == "body" and c.kind == JSON for c in columns)
    return ColumnPlan(
        tuple(columns), len(names), default_content_type="application/json" if json_body else None
    )


def _role_of(name: str, body_column: str, routing_key_column: str) -> str | None:
    if name == body_column:
        return "body"
    if name == routing_key_column:
        return "routing_key"
    if name in KNOWN_COLUMNS and name != "routing_key":
        return name
    return None


def _expected_key(role: str) -> str:
    if role in STRING_PROPERTIES or role == "exchange":
        return "string"
    return role


_EXPECTED: dict[str, str] = {
    "string": "string",
    "routing_key": "string",
    "body": "binary, string, or a type written as JSON (struct, map, array, number, boolean)",
    "headers": "map<string, string|binary|boolean|integer|long|double|decimal|timestamp>",
    "priority": "an integer type (byte, short, int, long)",
    "delivery_mode": "an integer type (byte, short, int, long)",
    "expiration": "string or an integer type (milliseconds)",
    "timestamp": "timestamp, timestamp_ntz or an integer type (POSIX seconds)",
}


def _kind_for_type(role: str, t: DataType) -> str | None:
    if role == "body":
        if isinstance(t, BinaryType):
            return AS_IS
        if isinstance(t, StringType):
            return UTF8
        return JSON
    if role in STRING_PROPERTIES or role in ("exchange", "routing_key"):
        return AS_IS if isinstance(t, StringType) else None
    if role in _INT_PROPERTIES:
        return AS_IS if isinstance(t, _INTEGER_TYPES) else None
    if role == "expiration":
        if isinstance(t, StringType):
            return AS_IS
        return TO_STR if isinstance(t, _INTEGER_TYPES) else None
    if role == "timestamp":
        if isinstance(t, TimestampType):
            return TS_LOCAL
        if isinstance(t, TimestampNTZType):
            return TS_NTZ
        return AS_IS if isinstance(t, _INTEGER_TYPES) else None
    if role == "headers":
        ok = (
            isinstance(t, MapType)
            and isinstance(t.keyType, StringType)
            and isinstance(t.valueType, _HEADER_VALUE_TYPES)
        )
        return MAP if ok else None
    return None


def _value_fits(role: str, value: object) -> bool:
    if role == "body":
        return True  # anything else becomes JSON
    if role in STRING_PROPERTIES or role in ("exchange", "routing_key"):
        return isinstance(value, str)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if role in _INT_PROPERTIES:
        return is_int
    if role == "expiration":
        return is_int or isinstance(value, str)
    if role == "timestamp":
        return is_int or isinstance(value, _dt.datetime)
    if role == "headers":
        return isinstance(value, Mapping)
    return False


def _kind_for_value(role: str, value: object) -> str:
    if role == "body" and value is not None:
        if isinstance(value, (bytes, bytearray)):
            return AS_IS
        return UTF8 if isinstance(value, str) else JSON
    if role == "body" or value is None:
        return AUTO if role in ("body", "expiration", "timestamp", "headers") else AS_IS
    if role == "expiration":
        return AS_IS if isinstance(value, str) else TO_STR
    if role == "timestamp":
        return TS_LOCAL if isinstance(value, _dt.datetime) else AS_IS
    if role == "headers":
        return MAP
    return AS_IS


# --- conversion (executors) ----------------------------------------------------------------------


def _arrow_values(array: Any, column: Column) -> list[Any]:
    import pyarrow as pa

    kind = column.kind
    if kind == UTF8:
        return list(array.cast(pa.binary()).to_pylist())
    if kind in (TS_LOCAL, TS_NTZ):
        # Arrow stores both as microseconds since the epoch (UTC, or wall clock for NTZ).
        return [None if v is None else v // 1_000_000 for v in array.cast(pa.int64()).to_pylist()]
    values: list[Any] = array.to_pylist()
    if kind == MAP:
        return [None if v is None else dict(v) for v in values]
    if kind == JSON:
        return [None if v is None else _json(v, column.data_type) for v in values]
    if kind == TO_STR:
        return [None if v is None else str(v) for v in values]
    return values


def _row_values(values: list[Any], column: Column) -> list[Any]:
    convert = _ROW_CONVERTERS.get(column.kind)
    if convert is None:
        return values
    return [None if v is None else convert(v, column) for v in values]


def _ts_local(v: Any, column: Column) -> Any:
    # pyspark gives TimestampType as a naive datetime in the local time zone
    return int(v.timestamp()) if isinstance(v, _dt.datetime) else v


def _ts_ntz(v: Any, column: Column) -> Any:
    return calendar.timegm(v.utctimetuple()) if isinstance(v, _dt.datetime) else v


def _auto(v: Any, column: Column) -> Any:
    if column.role == "body":
        if isinstance(v, (bytes, bytearray)):
            return v
        if isinstance(v, str):
            return v.encode("utf-8")
        return _json(v, None)
    if column.role == "expiration":
        return v if isinstance(v, str) else str(v)
    if column.role == "timestamp":
        return _ts_local(v, column)
    if column.role == "headers":
        return _ROW_CONVERTERS[MAP](v, column) if isinstance(v, Mapping) else v
    return v


_ROW_CONVERTERS: dict[str, Callable[[Any, Column], Any]] = {
    UTF8: lambda v, c: v.encode("utf-8"),
    JSON: lambda v, c: _json(v, c.data_type),
    TO_STR: lambda v, c: str(v),
    MAP: lambda v, c: {k: bytes(x) if isinstance(x, bytearray) else x for k, x in v.items()},
    TS_LOCAL: _ts_local,
    TS_NTZ: _ts_ntz,
    AUTO: _auto,
}


def _json(value: Any, data_type: DataType | None) -> bytes:
    return json.dumps(_plain(value, data_type), separators=(",", ":"), ensure_ascii=False).encode()


def _plain(value: Any, t: DataType | None) -> Any:
    """A value as JSON-ready Python: structs and maps as objects, binary as base64, decimals and
    dates as strings (so no precision is lost)."""
    if value is None:
        return None
    if isinstance(t, StructType):
        get = value.get if isinstance(value, Mapping) else value.__getitem__
        return {f.name: _plain(get(f.name), f.dataType) for f in t.fields}
    if isinstance(t, MapType):
        items: Iterable[Any] = value.items() if isinstance(value, Mapping) else value
        return {str(k): _plain(v, t.valueType) for k, v in items}
    if isinstance(t, ArrayType):
        return [_plain(v, t.elementType) for v in value]
    if isinstance(t, (TimestampType, TimestampNTZType, DateType)) or isinstance(
        value, (_dt.date, _dt.time)
    ):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, Decimal):
        return str(value)
    if t is None:  # no schema: Row objects, dicts and lists by what they are
        as_dict = getattr(value, "asDict", None)
        if as_dict is not None:
            return {k: _plain(v, None) for k, v in as_dict().items()}
        if isinstance(value, Mapping):
            return {str(k): _plain(v, None) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_plain(v, None) for v in value]
    return value
