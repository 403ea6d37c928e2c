"""Unit tests of ``_core/topology.py``: declarations, their validation and the record."""

from __future__ import annotations

from typing import Any, cast

import pytest

from reliable_amqp._core.errors import (
    ConfigurationError,
)
from reliable_amqp._core.topology import (
    METHODS,
    Topology,
    TopologyOp,
    bind_op,
    exchange_op,
    queue_op,
)


@pytest.mark.parametrize(
    ("build", "what"),
    [
        (exchange_op, "exchange"),
        (queue_op, "queue"),
        (lambda v: bind_op("q", "ex", v), "routing_key"),
    ],
)
@pytest.mark.parametrize(
    ("value", "problem"), [("n" * 256, "256 bytes long"), ("q\ud800", "UTF-8")]
)
def test_topology_names_amqp_cannot_carry_are_configuration_errors(
    build: Any, what: str, value: str, problem: str
) -> None:
    # The same shortstr check as publish() (a lone surrogate once escaped as UnicodeEncodeError).
    with pytest.raises(ConfigurationError) as info:
        build(value)
    assert what in str(info.value) and problem in str(info.value)


def test_exchange_op_records_every_argument() -> None:
    op = exchange_op("ex")
    assert op == TopologyOp(
        "exchange",
        {
            "exchange": "ex",
            "exchange_type": "direct",
            "durable": True,
            "auto_delete": False,
            "internal": False,
            "arguments": None,
        },
    )
    assert (op.method, op.describe()) == ("exchange_declare", "exchange 'ex'")
    args = {"alternate-exchange": "ae"}
    custom = exchange_op(
        "e2", "topic", durable=False, auto_delete=True, internal=True, arguments=args
    )
    assert custom.args["arguments"] == args and custom.args["arguments"] is not args
    assert (custom.args["exchange_type"], custom.args["durable"]) == ("topic", False)
    assert (custom.args["auto_delete"], custom.args["internal"]) == (True, True)


def test_queue_op_records_every_argument() -> None:
    op = queue_op("q", exclusive=True, arguments={"x-max-length": 10})
    assert op == TopologyOp(
        "queue",
        {
            "queue": "q",
            "durable": True,
            "exclusive": True,
            "auto_delete": False,
            "arguments": {"x-max-length": 10},
        },
    )
    assert (op.method, op.describe()) == ("queue_declare", "queue 'q'")
    assert queue_op("q", arguments={}).args["arguments"] is None  # empty means none


def test_bind_op_records_every_argument_and_allows_an_empty_key() -> None:
    op = bind_op("q", "ex")
    assert op == TopologyOp(
        "bind", {"queue": "q", "exchange": "ex", "routing_key": "", "arguments": None}
    )
    assert op.method == "queue_bind"
    assert bind_op("q", "ex", "k.#").describe() == (
        "binding of queue 'q' to exchange 'ex' with routing key 'k.#'"
    )
    assert METHODS == {
        "exchange": "exchange_declare",
        "queue": "queue_declare",
        "bind": "queue_bind",
    }


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: exchange_op(""), "exchange must not be empty"),
        (lambda: exchange_op("ex", ""), "exchange_type must not be empty"),
        (lambda: exchange_op(cast(Any, b"ex")), "exchange must be a str, not bytes"),
        (lambda: queue_op(""), "queue must not be empty"),
        (lambda: queue_op(cast(Any, None)), "queue must be a str, not NoneType"),
        (lambda: bind_op("", "ex"), "queue must not be empty"),
        (lambda: bind_op("q", ""), "exchange must not be empty"),
        (lambda: bind_op("q", "ex", cast(Any, 5)), "routing_key must be a str, not int"),
    ],
)
def test_empty_or_non_str_names_are_configuration_errors(build: Any, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        build()
    assert str(info.value) == message


def test_topology_keeps_declarations_once_in_order() -> None:
    topology = Topology()
    ops = [exchange_op("ex"), queue_op("q"), bind_op("q", "ex", "k")]
    for op in [*ops, exchange_op("ex"), queue_op("q")]:
        topology.record(op)
    assert len(topology) == 3 and list(topology) == ops
    topology.record(queue_op("q", durable=False))  # not identical: kept as well
    assert len(topology) == 4


def test_iterating_a_topology_sees_a_snapshot() -> None:
    topology = Topology()
    topology.record(queue_op("a"))
    seen = []
    for op in topology:
        seen.append(op)
        topology.record(queue_op("b"))  # recording while replaying does not extend the replay
    assert seen == [queue_op("a")] and len(topology) == 2
