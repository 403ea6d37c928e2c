"""Sink configuration, column plans, failure reports and the publisher cache (no Spark jobs)."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from decimal import Decimal
from typing import Any

import pytest
from pyspark.sql import Row
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from reliable_amqp import (
    ConfigurationError,
    DeliveryTimeout,
    MessageNacked,
    MessageReturned,
    OutgoingMessage,
    State,
)
from reliable_amqp._core.message import MessageProperties
from reliable_amqp.spark import AmqpSink, RowsNotConfirmed, SinkConfig
from reliable_amqp.spark._cache import cached_publisher, retire_publisher
from reliable_amqp.spark._mapping import JSON, _json
from reliable_amqp.spark._publish import failure_reason
from support.broker import AMQP_DEFAULT_PORT

pytestmark = pytest.mark.spark

URL = f"amqp://guest:guest@127.0.0.1:{AMQP_DEFAULT_PORT}/%2F"


def test_string_options_build_sink_and_publisher_options() -> None:
    config = SinkConfig.from_strings(
        {
            "url": f"{URL}, amqp://guest:guest@127.0.0.2:{AMQP_DEFAULT_PORT}/%2F",
            "exchange": "events",
            "routing_key": "orders",
            "mandatory": "False",
            "flush_timeout": "12.5",
            "id_prefix": "nightly",
            "checkpointlocation": "/tmp/ignored",
            "max_in_flight": "500",
            "delivery_timeout": "30",
            "nack_policy.max_attempts": "3",
            "nack_policy.initial_delay": "0.25",
            "connect_policy.max_retries": "4",
        }
    )
    assert (config.exchange, config.routing_key, config.mandatory) == ("events", "orders", False)
    assert (config.flush_deadline, config.id_prefix) == (12.5, "nightly")
    options = config.publisher
    assert len(options.urls) == 2
    assert (options.max_in_flight, options.delivery_timeout) == (500, 30.0)
    assert (options.nack_policy.max_attempts, options.nack_policy.initial_delay) == (3, 0.25)
    assert options.connect_policy.max_attempts == 5  # kombu's max_retries counts retries
    # defaults: mandatory, and a flush bound past every message's delivery deadline
    default = SinkConfig.from_strings({"url": URL})
    assert default.mandatory is True
    assert default.flush_deadline == default.publisher.delivery_timeout + 30


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs .option"),
        ({"url": URL, "max_inflight": "3"}, "unknown publisher option 'max_inflight'"),
        ({"url": URL, "mandatory": "yes"}, "mandatory must be true or false"),
        ({"url": URL, "flush_timeout": "soon"}, "flush_timeout must be a number"),
        ({"url": URL, "nack_policy": "3"}, "nack_policy.<field>"),
        ({"url": URL, "nack_policy.tries": "3"}, "unknown retry policy key 'tries'"),
        ({"url": "http://x"}, "must start with amqp://"),
    ],
)
def test_bad_string_options_are_named(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace(".", r"\.").replace("(", r"\(")):
        SinkConfig.from_strings(options)


def test_sink_validates_on_the_driver_and_pickles() -> None:
    import pickle

    with pytest.raises(ConfigurationError, match="unknown publisher option"):
        AmqpSink(URL, routing_key="q", max_inflight=3)
    with pytest.raises(ConfigurationError, match="flush_timeout"):
        AmqpSink(URL, routing_key="q", flush_timeout=-1)
    sink = AmqpSink(URL, routing_key="q", nack_policy={"max_attempts": 2})
    copy = pickle.loads(pickle.dumps(sink))
    assert copy.config == sink.config and copy._job == sink._job
    assert "guest:***@" in repr(sink)


def test_schema_problems_are_all_named_at_once() -> None:
    config = SinkConfig.from_strings({"url": URL})
    schema = StructType(
        [
            StructField("payload", StringType()),
            StructField("priority", StringType()),
            StructField("headers", MapType(IntegerType(), StringType())),
            StructField("extra", LongType()),
        ]
    )
    with pytest.raises(ConfigurationError) as info:
        config.plan(schema)
    text = str(info.value)
    for problem in (
        "column 'priority' (priority) has type string",
        "column 'headers' (headers) has type map<int,string>",
        "unknown column 'payload'",
        "unknown column 'extra'",
        "no body column 'body'",
        "no routing key",
        "nothing was sent",
    ):
        assert problem in text


def test_renamed_body_and_routing_key_columns() -> None:
    config = SinkConfig.from_strings(
        {"url": URL, "body_column": "payload", "routing_key_column": "topic"}
    )
    plan = config.plan(
        StructType([StructField("payload", BinaryType()), StructField("topic", StringType())])
    )
    assert [(c.name, c.role) for c in plan.columns] == [
        ("payload", "body"),
        ("topic", "routing_key"),
    ]
    chunk = plan.chunk_from_rows([(b"x", "a.b")])
    assert (chunk.bodies, chunk.routing_keys) == ([b"x"], ["a.b"])


def test_json_bodies_follow_the_spark_type() -> None:
    t = StructType(
        [
            StructField("n", LongType()),
            StructField("price", DecimalType(10, 2)),
            StructField("day", DateType()),
            StructField("tags", ArrayType(StringType())),
            StructField("attrs", MapType(StringType(), BinaryType())),
        ]
    )
    value: dict[str, Any] = {
        "n": 1,
        "price": Decimal("9.99"),
        "day": dt.date(2024, 1, 2),
        "tags": ["a"],
        "attrs": [("k", b"\x00\x01")],  # Arrow gives maps as (key, value) pairs
    }
    expected = b'{"n":1,"price":"9.99","day":"2024-01-02","tags":["a"],"attrs":{"k":"AAE="}}'
    assert _json(value, t) == expected
    row = Row(n=1, price=Decimal("9.99"), day=dt.date(2024, 1, 2), tags=["a"], attrs={"k": b"\0\1"})
    assert _json(row, t) == expected  # the Row path gives Rows and dicts
    assert _json(row, None) == expected  # and without a schema
    plan = SinkConfig.from_strings({"url": URL, "routing_key": "q"}).plan(
        StructType([StructField("body", t)])
    )
    assert plan.columns[0].kind == JSON and plan.default_content_type == "application/json"


def _message(mid: str) -> OutgoingMessage:
    return OutgoingMessage("", "q", b"x", MessageProperties(message_id=mid))


def test_failures_are_grouped_by_class_and_reply() -> None:
    failures = [MessageNacked(_message(f"n{i}"), 2) for i in range(3)] + [
        MessageReturned(_message("r"), 1, 312, "NO_ROUTE"),
        DeliveryTimeout(_message("t"), 1, 5.0),
    ]
    reasons: dict[str, int] = {}
    for exc in failures:
        reasons[failure_reason(exc)] = reasons.get(failure_reason(exc), 0) + 1
    error = RowsNotConfirmed(7, 100, reasons, ["n0", "n1"])
    text = str(error)
    assert text.startswith("5 of 100 rows of partition 7 were not confirmed by the broker: 3 x ")
    assert "MessageNacked" in text and "MessageReturned (312 NO_ROUTE)" in text
    assert "DeliveryTimeout (not confirmed within the 5 s delivery_timeout)" in text
    assert "same message ids" in text and error.failed == 5 and error.retriable


@pytest.mark.broker
def test_publishers_are_cached_per_process_and_rebuilt_after_closing(amqp_url: str) -> None:
    options = SinkConfig.from_strings({"url": amqp_url, "connection_name": "cache-test"}).publisher
    same = SinkConfig.from_strings({"url": amqp_url, "connection_name": "cache-test"}).publisher
    first = cached_publisher(options)
    assert cached_publisher(same) is first
    first.connect()
    first.close()
    assert first.state is State.CLOSED
    second = cached_publisher(options)
    assert second is not first
    retire_publisher(options, second)
    assert cached_publisher(options) is not second
    retire_publisher(options, cached_publisher(options))


def test_import_without_pyspark_names_the_extra() -> None:
    code = "import sys; sys.modules['pyspark'] = None; import reliable_amqp.spark"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode != 0
    assert "pip install '.[spark]'" in result.stderr
    plain = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['pyspark'] = None; import reliable_amqp"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert plain.returncode == 0, plain.stderr  # the core never needs Spark


def test_workers_that_cannot_import_the_library_are_named_before_a_job(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from reliable_amqp.spark import _workers

    # an interpreter on this machine without reliable_amqp: a bare venv of this Python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")], check=True)
    bare = str(tmp_path / "v" / "bin" / "python")
    local = SimpleNamespace(sparkContext=SimpleNamespace(master="local[2]", pythonExec=bare))
    with pytest.raises(ConfigurationError) as caught:
        _workers.check_workers(local)
    assert f"Spark's Python workers run {bare} " in str(caught.value)
    assert f"PYSPARK_PYTHON={sys.executable}" in str(caught.value)
    # the driver's own interpreter, or workers out of reach: nothing to say
    same = SimpleNamespace(master="local[2,3]", pythonExec=sys.executable)
    _workers.check_workers(same)
    _workers.check_workers(SimpleNamespace(master="spark://elsewhere:7077", pythonExec=bare))
    _workers.check_workers(object())  # Spark Connect: no sparkContext


def test_rows_not_confirmed_does_not_promise_a_retry() -> None:
    text = str(RowsNotConfirmed(1, 10, {"MessageNacked": 10}, ["a:1:0"]))
    assert "Spark retries the task when it allows retries" in text
    assert "local[N] master does not" in text
