"""Unit tests of ``_core/message.py``: what ``build_message`` accepts, rejects and builds.

Some tests pin down bugs found while writing them (fixed in 8ee60dd): values that passed
validation but that no AMQP encoder can write.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import pickle
from decimal import Decimal
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from pika.spec import BasicProperties

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.errors import (
    InvalidMessage,
)
from reliable_amqp._core.message import (
    PERSISTENT,
    Confirmation,
    MessageProperties,
    OutgoingMessage,
    checked,
    new_confirmation,
    new_message_id,
    new_message_ids,
)


def _invalid(field: str, *args: Any, **kwargs: Any) -> InvalidMessage:
    with pytest.raises(InvalidMessage) as info:
        build_message(*args, **kwargs)
    assert info.value.field == field
    assert field in str(info.value)
    return info.value


def _props(**properties: Any) -> OutgoingMessage:
    return build_message("ex", "rk", b"body", properties=properties)


# --- build_message: rejected input ----------------------------------------------------------------


@pytest.mark.parametrize("body", ["text", 42, None, 1.5, ["b"], {"b": 1}])
def test_body_must_be_bytes_like(body: object) -> None:
    error = _invalid("body", "ex", "rk", body)
    assert type(body).__name__ in error.problem
    if isinstance(body, str):
        assert "encode" in error.problem


@pytest.mark.parametrize("name", ["exchange", "routing_key"])
@pytest.mark.parametrize("value", ["a" * 256, "é" * 128, "€" * 86])
def test_names_over_255_utf8_bytes_are_rejected(name: str, value: str) -> None:
    args = {"exchange": "ex", "routing_key": "rk", name: value}
    error = _invalid(name, args["exchange"], args["routing_key"], b"")
    assert str(len(value.encode())) in error.problem


@pytest.mark.parametrize("name", ["exchange", "routing_key"])
@pytest.mark.parametrize("value", ["q\ud800", "\udfff" * 3, "é\udc80"])
def test_names_utf8_cannot_encode_are_rejected(name: str, value: str) -> None:
    # A lone surrogate passed every check once and then failed the frame encoder on the I/O
    # thread, taking every other message in flight with it.
    args = {"exchange": "ex", "routing_key": "rk", name: value}
    error = _invalid(name, args["exchange"], args["routing_key"], b"")
    assert "UTF-8" in error.problem and "position" in error.problem


@pytest.mark.parametrize(
    ("properties", "field"),
    [
        ({"headers": {"k": "v\ud800"}}, "headers['k']"),
        ({"headers": {"k\ud800": 1}}, "headers['k\\ud800']"),
        ({"headers": {"a": ["ok", {"b": "\udc00"}]}}, "headers['a'][1]['b']"),
        ({"correlation_id": "c\ud800"}, "correlation_id"),
        ({"message_id": "\ud800"}, "message_id"),
    ],
)
def test_text_utf8_cannot_encode_is_rejected_in_properties(
    properties: dict[str, Any], field: str
) -> None:
    error = _invalid(field, "ex", "rk", b"", properties=properties)
    assert "UTF-8" in error.problem


def test_messages_built_fast_equal_the_dataclass_constructors() -> None:
    message = build_message("ex", "rk", b"body", mandatory=True)
    expected = OutgoingMessage(
        "ex", "rk", b"body", MessageProperties(message_id=message.message_id), True
    )
    assert message == expected and repr(message) == repr(expected)
    assert message.properties == expected.properties
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.properties.message_id = "other"  # type: ignore[misc]
    confirmation = new_confirmation("id-7", 2)
    assert confirmation == Confirmation("id-7", 2) and repr(confirmation) == repr(
        Confirmation("id-7", 2)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        confirmation.attempts = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["exchange", "routing_key"])
@pytest.mark.parametrize("value", [None, b"ex", 7])
def test_names_must_be_str(name: str, value: object) -> None:
    args: dict[str, object] = {"exchange": "ex", "routing_key": "rk", name: value}
    _invalid(name, args["exchange"], args["routing_key"], b"")


@pytest.mark.parametrize("value", ["a" * 255, "é" * 127 + "a", ""])
def test_names_up_to_255_utf8_bytes_are_accepted(value: str) -> None:
    message = build_message(value, value, b"")
    assert (message.exchange, message.routing_key) == (value, value)


@pytest.mark.parametrize(
    "headers, field",
    [
        ({"k": object()}, "headers['k']"),
        ({"k": {1, 2}}, "headers['k']"),
        ({"k": 1j}, "headers['k']"),
        ({"k": bytearray(b"x")}, "headers['k']"),
        ({"k": 2**63}, "headers['k']"),
        ({"k": -(2**63) - 1}, "headers['k']"),
        ({"a": {"b": [1, "x", object()]}}, "headers['a']['b'][2]"),
        ({1: "x"}, "headers[1]"),
        ({"a": {(1, 2): "x"}}, "headers['a'][(1, 2)]"),
        ({"k" * 256: 1}, f"headers[{'k' * 256!r}]"),
    ],
)
def test_header_values_and_keys_amqp_cannot_encode_are_rejected(
    headers: dict[Any, Any], field: str
) -> None:
    _invalid(field, "ex", "rk", b"", properties={"headers": headers})


def test_headers_nested_too_deep_are_rejected() -> None:
    deep: dict[str, Any] = {"v": 1}
    for _ in range(40):
        deep = {"n": deep}
    with pytest.raises(InvalidMessage, match="nested deeper"):
        _props(headers=deep)


@pytest.mark.parametrize("headers", [[("k", 1)], "k=1", 5])
def test_headers_must_be_a_mapping(headers: object) -> None:
    _invalid("headers", "ex", "rk", b"", properties={"headers": headers})


@pytest.mark.parametrize("name", ["colour", "deliverymode", "x-header", "Headers"])
def test_unknown_property_keyword_is_rejected(name: str) -> None:
    error = _invalid(name, "ex", "rk", b"", properties={name: "v"})
    assert "content_type" in error.problem  # lists the known ones


@pytest.mark.parametrize("priority", [-1, 256, "1", 1.0, True])
def test_priority_out_of_range_or_not_int_is_rejected(priority: object) -> None:
    _invalid("priority", "ex", "rk", b"", properties={"priority": priority})


@pytest.mark.parametrize("expiration", ["-1", "1.5", "", "soon", " 10", 1.5, -5, True])
def test_bad_expiration_is_rejected(expiration: object) -> None:
    _invalid("expiration", "ex", "rk", b"", properties={"expiration": expiration})


@pytest.mark.parametrize("delivery_mode", [0, 3, "2", b"\x02"])
def test_bad_delivery_mode_is_rejected(delivery_mode: object) -> None:
    _invalid("delivery_mode", "ex", "rk", b"", properties={"delivery_mode": delivery_mode})


@pytest.mark.parametrize(
    "name, value",
    [
        ("message_id", ""),
        ("message_id", 5),
        ("content_type", "t" * 256),
        ("app_id", b"app"),
        ("timestamp", "now"),
        ("timestamp", 1.5),
        ("timestamp", -1),
        ("timestamp", True),
        ("timestamp", 2**64),
    ],
)
def test_other_bad_properties_are_rejected(name: str, value: object) -> None:
    _invalid(name, "ex", "rk", b"", properties={name: value})


@pytest.mark.parametrize("mandatory", ["yes", 1, None])
def test_mandatory_must_be_bool(mandatory: Any) -> None:
    _invalid("mandatory", "ex", "rk", b"", mandatory=mandatory)


# --- build_message: accepted input ----------------------------------------------------------------


@pytest.mark.parametrize("body", [bytearray(b"abc"), memoryview(b"abc"), b"abc"])
def test_bytes_like_bodies_become_bytes(body: Any) -> None:
    message = build_message("ex", "rk", body)
    assert type(message.body) is bytes and message.body == b"abc"
    if isinstance(body, bytearray):
        body[0] = ord("z")  # the caller's buffer is copied, not shared
        assert message.body == b"abc"


def test_defaults_are_persistent_with_a_generated_id() -> None:
    message = build_message("ex", "rk", b"")
    assert message.properties.delivery_mode == PERSISTENT == 2
    assert message.message_id and message.mandatory is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.body = b"x"


def test_nested_headers_and_all_properties_are_accepted() -> None:
    when = dt.datetime(2024, 5, 6, 7, 8, 9)
    headers = {
        "s": "x",
        "b": b"\x00",
        "i": -(2**63),
        "j": 2**63 - 1,
        "t": True,
        "n": None,
        "f": 1.5,
        "d": Decimal("1.25"),
        "w": when,
        "l": [1, "a", [2, {"deep": "er"}]],
        "m": {"nested": {"more": [None]}},
    }
    message = build_message(
        "ex",
        "rk",
        b"{}",
        mandatory=True,
        properties={
            "headers": headers,
            "content_type": "application/json",
            "content_encoding": "utf-8",
            "delivery_mode": 1,
            "priority": 255,
            "correlation_id": "c",
            "reply_to": "r",
            "expiration": 60000,
            "message_id": "my-id",
            "timestamp": when,
            "type": "t",
            "user_id": "guest",
            "app_id": "a",
        },
    )
    p = message.properties
    assert p.headers == headers and p.headers is not headers
    assert p.expiration == "60000"  # ints are turned into the string AMQP wants
    assert p.timestamp == int(when.replace(tzinfo=dt.timezone.utc).timestamp())
    assert (p.delivery_mode, p.priority, p.message_id) == (1, 255, "my-id")
    assert message.message_id == "my-id" and message.mandatory is True


def test_aware_timestamp_is_converted_and_int_timestamp_kept() -> None:
    aware = dt.datetime(2024, 1, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert _props(timestamp=aware).properties.timestamp == 1704067200
    assert _props(timestamp=1704067200).properties.timestamp == 1704067200


def test_properties_given_as_none_are_unset() -> None:
    message = _props(headers=None, priority=None, message_id=None)
    assert message.properties.headers is None and message.properties.priority is None
    assert message.message_id  # generated, since None means "not set"


def test_repr_shows_size_not_body() -> None:
    message = build_message("ex", "rk", b"secret-payload")
    assert "secret-payload" not in repr(message)
    assert "14 bytes" in repr(message)


def test_generated_message_ids_are_unique() -> None:
    ids = {new_message_id() for _ in range(20_000)}
    ids |= {build_message("e", "r", b"").message_id for _ in range(5_000)}
    ids |= {_props(priority=1).message_id for _ in range(5_000)}
    many = new_message_ids(5_000)
    ids |= set(many)
    assert len(ids) == 35_000 and len(many) == 5_000
    assert all(ids)
    # the same form: one prefix, a dash, a hex counter that goes on from the single ids
    prefix, counter = many[0].rsplit("-", 1)
    assert new_message_id().rsplit("-", 1)[0] == prefix
    assert [int(i.rsplit("-", 1)[1], 16) for i in many] == list(
        range(int(counter, 16), int(counter, 16) + 5_000)
    )


@settings(max_examples=100, deadline=None)
@given(value=st.integers(min_value=2**63) | st.integers(max_value=-(2**63) - 1))
def test_ints_beyond_int64_are_rejected_anywhere_in_headers(value: int) -> None:
    _invalid("headers['a'][0]['b']", "ex", "rk", b"", properties={"headers": {"a": [{"b": value}]}})


# Values that passed validation although no AMQP encoder can write them (fixed in 8ee60dd): the
# sync publisher, writing with pika, then failed in its I/O loop instead of publish() raising.


def test_float_delivery_mode_is_rejected() -> None:
    _invalid("delivery_mode", "ex", "rk", b"", properties={"delivery_mode": 2.0})


@pytest.mark.parametrize("expiration", ["\u0661\u0660", "\u00b2", "\uff11\uff10"])
def test_non_ascii_digit_expiration_is_rejected(expiration: str) -> None:
    _invalid("expiration", "ex", "rk", b"", properties={"expiration": expiration})


def test_pre_epoch_timestamp_is_rejected() -> None:
    _invalid("timestamp", "ex", "rk", b"", properties={"timestamp": dt.datetime(1969, 12, 31)})
    assert _props(timestamp=dt.datetime(1970, 1, 1)).properties.timestamp == 0


def test_pre_epoch_datetime_header_is_rejected() -> None:
    headers = {"at": dt.datetime(1960, 1, 1)}
    _invalid("headers['at']", "ex", "rk", b"", properties={"headers": headers})


@pytest.mark.parametrize("value", ["NaN", "sNaN", "Infinity", "1e100", "4294967296", "1e-300"])
def test_decimal_header_outside_amqp_decimal_is_rejected(value: str) -> None:
    _invalid("headers['d']", "ex", "rk", b"", properties={"headers": {"d": Decimal(value)}})


@pytest.mark.parametrize("value", ["2147483647", "-2147483648", "0.000001", "1E+3", "-12.5"])
def test_decimal_header_inside_amqp_decimal_is_accepted(value: str) -> None:
    headers = {"d": Decimal(value)}
    assert BasicProperties(headers=_props(headers=headers).properties.headers).encode()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_float_header_is_rejected(value: float) -> None:
    _invalid("headers['f']", "ex", "rk", b"", properties={"headers": {"f": value}})


def test_tuples_in_headers_become_lists() -> None:
    headers = _props(headers={"t": (1, ("a", {"u": (2,)}))}).properties.headers
    assert headers == {"t": [1, ["a", {"u": [2]}]]}


_amqp_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.decimals(places=None, allow_nan=True, allow_infinity=True)
    | st.datetimes(min_value=dt.datetime(1900, 1, 1), max_value=dt.datetime(2200, 1, 1))
)
_header_value = st.recursive(
    _amqp_leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(headers=st.dictionaries(st.text(max_size=10), _header_value, max_size=5))
def test_headers_are_rejected_or_encodable(headers: dict[str, Any]) -> None:
    """Whatever build_message accepts, an AMQP encoder (pika's) can write.

    Floats are left out: valid AMQP, but pika cannot encode them (the sync publisher refuses
    them when publishing).
    """
    try:
        message = _props(headers=headers)
    except InvalidMessage as exc:
        assert exc.field.startswith("headers[")
        return
    assert BasicProperties(headers=message.properties.headers).encode()


def test_message_properties_default_is_persistent() -> None:
    assert MessageProperties().delivery_mode == PERSISTENT


# --- inputs that passed validation and then cost a channel or the connection (issue 11) ---------


@pytest.mark.parametrize("value", [5, "q", None, [1], ["q", b"x"], {"q": 1}])
@pytest.mark.parametrize("name", ["CC", "BCC"])
def test_routing_headers_must_be_lists_of_str(name: str, value: object) -> None:
    # RabbitMQ closes the channel (406 unacceptable_type_in_header) for anything else.
    _invalid(f"headers[{name!r}]", "", "rk", b"", properties={"headers": {name: value}})
    built = _props(headers={name: ("a", "b")})
    assert built.properties.headers == {name: ["a", "b"]}


def test_expiration_over_ten_years_is_rejected() -> None:
    # RabbitMQ: 406 "invalid expiration ... value_too_large"
    _invalid("expiration", "ex", "rk", b"", properties={"expiration": 315_360_000_001})
    _invalid("expiration", "ex", "rk", b"", properties={"expiration": "1" + "0" * 30})
    assert _props(expiration="0315360000000").properties.expiration == "0315360000000"


def test_reply_to_the_direct_reply_to_pseudo_queue_is_rejected() -> None:
    # A publisher never consumes from it: 406 "fast reply consumer does not exist".
    _invalid("reply_to", "ex", "rk", b"", properties={"reply_to": "amq.rabbitmq.reply-to"})
    assert _props(reply_to="amq.rabbitmq.reply-to.x").properties.reply_to


@pytest.mark.parametrize(
    "key",
    ["amq.rabbitmq.reply-to.g.h", "amq.rabbitmq.reply-to..a..b.", "amq.rabbitmq.reply-to.g1h2.k"],
)
def test_malformed_direct_reply_to_addresses_are_rejected(key: str) -> None:
    # RabbitMQ 3.10 closes the connection (541) when it cannot decode one.
    _invalid("routing_key", "", key, b"")
    assert build_message("amq.direct", key, b"").routing_key == key  # only the default exchange


@pytest.mark.parametrize(
    "key",
    [
        "amq.rabbitmq.reply-to.g1h2AA1yZXBseUA5MjQ4ODg0AABzFQAAAAJrA7gB.HHCtY8E+B/NMr2eiv/TdYA==",
        "amq.rabbitmq.reply-to.a.b.c",  # not two parts: merely unroutable
        "amq.rabbitmq.reply-to",
    ],
)
def test_issued_direct_reply_to_addresses_are_accepted(key: str) -> None:
    assert build_message("", key, b"").routing_key == key


@pytest.mark.parametrize(
    "value",
    [
        dt.datetime(1969, 12, 31, 23, 59, 59, 500000),  # int(timestamp()) is 0, the encoder -1
        dt.datetime(9999, 12, 31, 23, tzinfo=dt.timezone(-dt.timedelta(hours=2))),  # overflow
        dt.datetime(1, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1))),
    ],
)
def test_header_datetimes_outside_u64_seconds_are_rejected(value: dt.datetime) -> None:
    # Both raised other exceptions (struct.error, OverflowError) from publish() before.
    _invalid("headers['t']", "", "rk", b"", properties={"headers": {"t": value}})
    _invalid("timestamp", "", "rk", b"", properties={"timestamp": value})


def test_header_datetimes_round_down_like_the_encoder() -> None:
    value = dt.datetime(1970, 1, 1, 0, 0, 1, 999999)
    assert _props(headers={"t": value}).properties.headers == {"t": value}
    assert _props(timestamp=value).properties.timestamp == 1


def test_only_what_build_message_made_counts_as_checked() -> None:
    # publish_message() takes such a message without checking its fields again
    made = build_message("ex", "rk", b"x", properties={"priority": 3})
    assert checked(made)
    assert not checked(made.replace(body=b"y"))
    assert not checked(OutgoingMessage("ex", "rk", b"x", made.properties))
    assert not checked(pickle.loads(pickle.dumps(made)))
