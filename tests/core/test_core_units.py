"""Unit tests of the I/O-free core: message validation, retry policy, reply codes, options, states.

Some tests pin down bugs found while writing them (fixed in 8ee60dd): values that passed
validation but that no AMQP encoder can write, passwords shown in errors about malformed URLs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
from decimal import Decimal
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from pika.spec import BasicProperties

from reliable_amqp._core.engine import is_permanent_channel_close
from reliable_amqp._core.errors import (
    REPLY_CODE_ERRORS,
    AccessRefused,
    AmqpConnectionError,
    AuthenticationFailed,
    BrokerError,
    ChannelError,
    CommandInvalid,
    ConfigurationError,
    ConnectionForced,
    ContentTooLarge,
    DeliveryTimeout,
    FrameError,
    InternalError,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    NoConsumers,
    NoRoute,
    NotAllowed,
    NotFound,
    NotImplemented_,
    PreconditionFailed,
    PublisherClosed,
    ReliableAmqpError,
    ResourceError,
    ResourceLocked,
    SyntaxError_,
    UnexpectedFrame,
    broker_error,
)
from reliable_amqp._core.message import (
    PERSISTENT,
    Confirmation,
    MessageProperties,
    OutgoingMessage,
    build_message,
    new_confirmation,
    new_message_id,
)
from reliable_amqp._core.options import (
    DEFAULT_CONNECT_POLICY,
    DEFAULT_NACK_POLICY,
    PublisherOptions,
    check_url,
    redact_url,
)
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.state import (
    TRANSITIONS,
    WRITABLE,
    InvalidTransition,
    State,
    StateMachine,
)
from reliable_amqp._core.topology import bind_op, exchange_op, queue_op

PASSWORD = "s3cretPW"
URL = f"amqp://guest:{PASSWORD}@localhost:5672/%2F"


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
        message.body = b"x"  # type: ignore[misc]


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
    assert len(ids) == 30_000
    assert all(ids)


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


# --- RetryPolicy ----------------------------------------------------------------------------------


def test_delays_grow_and_cap_at_max_delay() -> None:
    policy = RetryPolicy(initial_delay=0.1, multiplier=2.0, max_delay=1.0, jitter=0.0)
    delays = [policy.base_delay(n) for n in range(1, 8)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert policy.base_delay(0) == policy.base_delay(1)
    assert policy.base_delay(100_000) == 1.0  # no OverflowError after many failures
    assert policy.delay(3, rng=lambda: 0.99) == pytest.approx(0.4)


def test_jitter_adds_up_to_jitter_seconds() -> None:
    policy = RetryPolicy(initial_delay=1.0, jitter=0.5, max_delay=10.0)
    assert policy.delay(1, rng=lambda: 0.0) == 1.0
    assert policy.delay(1, rng=lambda: 1.0) == 1.5
    assert 1.0 <= policy.delay(1) <= 1.5


def test_step_adds_linear_growth() -> None:
    policy = RetryPolicy(initial_delay=1.0, multiplier=1.0, step=0.5, max_delay=2.2, jitter=0)
    assert [policy.base_delay(n) for n in range(1, 6)] == [1.0, 1.5, 2.0, 2.2, 2.2]


def test_zero_initial_delay_stays_zero_after_many_failures() -> None:
    policy = RetryPolicy(max_attempts=None, initial_delay=0.0, max_delay=5.0, jitter=0.0)
    assert policy.base_delay(1000) == 0.0
    assert policy.base_delay(2000) == 0.0


def test_allows_stops_at_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert [policy.allows(n) for n in range(5)] == [True, True, True, False, False]
    unlimited = RetryPolicy(max_attempts=None)
    assert unlimited.allows(10**9, elapsed=10**9)


def test_allows_stops_when_the_next_attempt_would_start_after_the_deadline() -> None:
    policy = RetryPolicy(max_attempts=None, initial_delay=1.0, jitter=0.0, deadline=10.0)
    assert policy.allows(1, elapsed=9.0)
    assert not policy.allows(1, elapsed=9.5)
    assert not policy.allows(1, elapsed=20.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"initial_delay": -0.1},
        {"max_delay": float("inf")},
        {"jitter": float("nan")},
        {"step": -1.0},
        {"multiplier": 0.5},
        {"multiplier": float("nan")},
        {"deadline": 0},
        {"deadline": -5.0},
    ],
)
def test_invalid_policies_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(kwargs))):
        RetryPolicy(**kwargs)


def test_from_dict_accepts_its_own_fields_and_round_trips() -> None:
    policy = RetryPolicy(max_attempts=7, initial_delay=0.3, max_delay=4.0, multiplier=3.0,
                         step=0.1, jitter=0.0, deadline=30.0)  # fmt: skip
    assert RetryPolicy.from_dict(policy.to_dict()) == policy
    assert RetryPolicy.from_dict(policy) is policy
    assert RetryPolicy.from_dict(None) == RetryPolicy()
    assert RetryPolicy.from_dict({}) == RetryPolicy()
    assert RetryPolicy.from_dict({"max_attempts": None}).max_attempts is None


def test_from_dict_fills_missing_fields_from_base() -> None:
    base = RetryPolicy(max_attempts=9, initial_delay=0.7, jitter=0.0, deadline=50.0)
    assert RetryPolicy.from_dict(None, base=base) is base
    assert RetryPolicy.from_dict({"deadline": "30"}, base=base) == dataclasses.replace(
        base, deadline=30.0
    )
    assert RetryPolicy.from_dict({"interval_max": 3}, base=base) == dataclasses.replace(
        base, max_delay=3.0, multiplier=1.0
    )


def test_from_dict_accepts_kombu_keys_with_linear_growth() -> None:
    policy = RetryPolicy.from_dict(
        {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
    )
    assert policy.max_attempts == 4  # kombu counts retries, the policy counts attempts
    assert (policy.multiplier, policy.jitter) == (1.0, 0.0)
    assert [policy.delay(n) for n in range(1, 6)] == pytest.approx([0.0, 0.2, 0.4, 0.5, 0.5])
    assert [policy.allows(n) for n in range(3, 6)] == [True, False, False]


def test_from_dict_accepts_string_values() -> None:
    policy = RetryPolicy.from_dict(
        {"max_attempts": " 3 ", "initial_delay": "0.5", "max_delay": "8", "deadline": "none"}
    )
    assert (policy.max_attempts, policy.initial_delay, policy.max_delay) == (3, 0.5, 8.0)
    assert policy.deadline is None
    assert RetryPolicy.from_dict({"deadline": "12.5"}).deadline == 12.5
    assert RetryPolicy.from_dict({"max_attempts": ""}).max_attempts is None
    kombu = RetryPolicy.from_dict({"max_retries": "2", "interval_start": "1", "interval_step": "1"})
    assert (kombu.max_attempts, kombu.base_delay(2)) == (3, 2.0)
    assert RetryPolicy.from_dict({"max_retries": "none"}).max_attempts is None


@pytest.mark.parametrize(
    "config, named",
    [
        ({"retries": 3}, "retries"),
        ({"max_attempts": 3, "backoff": 2}, "backoff"),
        ({"max_attempts": "three"}, "max_attempts"),
        ({"max_attempts": 2.5}, "max_attempts"),
        ({"max_attempts": "2.5"}, "max_attempts"),
        ({"max_attempts": "0"}, "max_attempts"),
        ({"initial_delay": "soon"}, "initial_delay"),
        ({"initial_delay": True}, "initial_delay"),
        ({"multiplier": "0.5"}, "multiplier"),
        ({"jitter": "nan"}, "jitter"),
        ({"deadline": "-1"}, "deadline"),
        ({"max_retries": "x"}, "max_retries"),
        ({"max_retries": -1}, "max_attempts"),
        ({"interval_start": [1]}, "interval_start"),
    ],
)
def test_from_dict_rejects_unknown_keys_and_bad_values(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        RetryPolicy.from_dict(config)


@pytest.mark.parametrize("config", ["max_attempts=3", 3, ["max_attempts"]])
def test_from_dict_rejects_non_mappings(config: Any) -> None:
    with pytest.raises(ConfigurationError, match="mapping"):
        RetryPolicy.from_dict(config)


_FAST = RetryPolicy(max_attempts=5, initial_delay=0, jitter=0)


def _failing(times: int, error: BaseException) -> Any:
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    call.calls = calls  # type: ignore[attr-defined]
    return call


@pytest.mark.parametrize(
    "error",
    [AmqpConnectionError("lost"), broker_error(320, "CONNECTION_FORCED"), broker_error(541, "")],
)
def test_retrying_retries_retriable_errors(error: BaseException) -> None:
    call = _failing(2, error)
    assert _FAST.retrying()(call) == "done"
    assert len(call.calls) == 3


@pytest.mark.parametrize(
    "error",
    [
        ConfigurationError("bad"),
        AuthenticationFailed("no"),
        broker_error(404, "NOT_FOUND"),
        ValueError("not ours"),
    ],
)
def test_retrying_does_not_retry_other_errors(error: BaseException) -> None:
    call = _failing(1, error)
    with pytest.raises(type(error)) as info:
        _FAST.retrying()(call)
    assert info.value is error
    assert len(call.calls) == 1


def test_retrying_stops_at_max_attempts_and_reraises_the_error() -> None:
    error = AmqpConnectionError("down")
    call = _failing(100, error)
    with pytest.raises(AmqpConnectionError) as info:
        RetryPolicy(max_attempts=3, initial_delay=0, jitter=0).retrying()(call)
    assert info.value is error
    assert len(call.calls) == 3


def test_retrying_waits_as_the_policy_says() -> None:
    slept: list[float] = []
    policy = RetryPolicy(max_attempts=4, initial_delay=0.1, multiplier=3.0, jitter=0)
    call = _failing(3, AmqpConnectionError("x"))
    assert policy.retrying(sleep=slept.append)(call) == "done"
    assert slept == pytest.approx([0.1, 0.3, 0.9])


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, cls, retriable",
    [
        (311, ContentTooLarge, False),
        (312, NoRoute, False),
        (313, NoConsumers, False),
        (320, ConnectionForced, True),
        (403, AccessRefused, False),
        (404, NotFound, False),
        (405, ResourceLocked, True),
        (406, PreconditionFailed, False),
        (501, FrameError, False),
        (502, SyntaxError_, False),
        (503, CommandInvalid, False),
        (504, ChannelError, False),
        (505, UnexpectedFrame, False),
        (506, ResourceError, True),
        (530, NotAllowed, False),
        (540, NotImplemented_, False),
        (541, InternalError, True),
    ],
)
def test_reply_codes_map_to_exception_classes(code: int, cls: type, retriable: bool) -> None:
    error = broker_error(code, "TEXT - why")
    assert type(error) is cls and cls.reply_code == code
    assert REPLY_CODE_ERRORS[code] is cls
    assert (error.code, error.text) == (code, "TEXT - why")
    assert str(error) == f"{code} TEXT - why"
    assert error.retriable is retriable
    assert isinstance(error, BrokerError) and isinstance(error, ReliableAmqpError)


@pytest.mark.parametrize("code", [0, 200, 999, 407])
def test_unknown_reply_codes_give_a_plain_broker_error(code: int) -> None:
    error = broker_error(code, "odd")
    assert type(error) is BrokerError
    assert (error.code, error.retriable) == (code, False)


def test_reply_code_table_is_complete_and_consistent() -> None:
    assert len(REPLY_CODE_ERRORS) == 17
    assert all(code == cls.reply_code for code, cls in REPLY_CODE_ERRORS.items())


@pytest.mark.parametrize(
    "code, text, permanent",
    [
        (404, "NOT_FOUND - no exchange 'x' in vhost '/'", True),
        (406, "PRECONDITION_FAILED - message size 9 is larger than configured max size 8", True),
        (406, "PRECONDITION_FAILED - low disk space", False),
        (403, "ACCESS_REFUSED", True),
        (320, "CONNECTION_FORCED", False),
        (541, "INTERNAL_ERROR", False),
        (506, "RESOURCE_ERROR", False),
        (None, "socket closed", False),
        (999, "unknown", False),
    ],
)
def test_which_channel_closes_blame_a_message(code: int | None, text: str, permanent: bool) -> None:
    assert is_permanent_channel_close(code, text) is permanent


def test_publish_errors_carry_the_message() -> None:
    message = build_message("ex", "rk", b"", properties={"message_id": "m-1"})
    rejected = MessageRejected(message, 2, 404, "NOT_FOUND")
    assert rejected.message is message and rejected.attempts == 2
    assert isinstance(rejected.cause, NotFound) and "m-1" in str(rejected)
    returned = MessageReturned(message, 1, 312, "NO_ROUTE")
    assert "'ex'" in str(returned) and "'rk'" in str(returned)
    assert isinstance(DeliveryTimeout(message, 1, 5.0), TimeoutError)
    assert MessageNacked(message, 3).retriable and PublisherClosed(message, 0).retriable
    assert not rejected.retriable and not returned.retriable
    assert isinstance(InvalidMessage("body", "x"), ValueError)
    assert isinstance(ConfigurationError("x"), ValueError)


# --- options --------------------------------------------------------------------------------------


def test_create_with_defaults_and_several_urls() -> None:
    options = PublisherOptions.create(URL)
    assert options.urls == (URL,)
    assert (options.max_in_flight, options.delivery_timeout) == (10_000, 120.0)
    assert options.nack_policy == DEFAULT_NACK_POLICY
    two = PublisherOptions.create([URL, "amqps://h2:5671/vh"], max_in_flight=5)
    assert two.urls == (URL, "amqps://h2:5671/vh") and two.max_in_flight == 5


def test_create_rejects_unknown_options() -> None:
    with pytest.raises(ConfigurationError, match="'max_inflight'"):
        PublisherOptions.create(URL, max_inflight=10)


@pytest.mark.parametrize(
    "url",
    [
        f"http://guest:{PASSWORD}@localhost/",
        f"amqp://guest:{PASSWORD}@localhost:99999/",
        f"amqp://guest:{PASSWORD}@localhost:port/",
        f"amqp://guest:{PASSWORD}@/",
        f"//guest:{PASSWORD}@localhost/",
        "",
    ],
)
def test_malformed_urls_are_rejected_without_showing_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(url)
    assert PASSWORD not in str(info.value)
    assert "URL" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"guest:{PASSWORD}@localhost:5672/%2F",
        "amqp://guest:pass/word@localhost:5672/",
        "amqp://guest:pass#word@localhost:5672/",
        "amqp://guest:pass?word@localhost:5672/",
    ],
)
def test_malformed_urls_never_show_the_password(url: str) -> None:
    password = url.split("@", maxsplit=1)[0].split(":", 2)[-1].removeprefix("//")
    with pytest.raises(ConfigurationError) as info:
        check_url(url)
    assert password not in str(info.value)


@pytest.mark.parametrize(
    "options",
    [
        {"max_in_flight": 0},
        {"max_in_flight": "10"},
        {"max_in_flight_bytes": -1},
        {"delivery_timeout": 0},
        {"publish_timeout": float("inf")},
        {"connect_timeout": float("nan")},
        {"close_timeout": True},
        {"blocked_timeout": 0},
        {"heartbeat": -1},
        {"heartbeat": 70_000},
        {"heartbeat": 1.5},
        {"nack_policy": {"max_attempts": 0}},
        {"connect_policy": "fast"},
    ],
)
def test_create_rejects_bad_values(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(URL, **options)
    assert PASSWORD not in str(info.value)


def test_policies_may_be_given_as_dicts_over_the_option_defaults() -> None:
    options = PublisherOptions.create(URL, nack_policy={"max_retries": 1}, connect_policy=None)
    assert options.nack_policy == dataclasses.replace(
        DEFAULT_NACK_POLICY, max_attempts=2, multiplier=1.0, jitter=0.0
    )
    assert options.connect_policy == DEFAULT_CONNECT_POLICY
    partial = PublisherOptions.create(URL, connect_policy={"deadline": "30"})
    assert partial.connect_policy == dataclasses.replace(DEFAULT_CONNECT_POLICY, deadline=30.0)


@pytest.mark.parametrize(
    "url, shown",
    [
        (URL, "amqp://guest:***@localhost:5672/%2F"),
        ("amqps://u:p%40ss@h/vh", "amqps://u:***@h/vh"),
        ("amqp://u:p@ss@h:5672", "amqp://u:***@h:5672"),
        ("amqp://u:@h/", "amqp://u:***@h/"),
        ("amqp://u@h/", "amqp://u@h/"),
        ("amqp://h:5672/", "amqp://h:5672/"),
    ],
)
def test_redact_url_hides_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_repr_of_options_hides_passwords() -> None:
    options = PublisherOptions.create([URL, f"amqp://u:{PASSWORD}x@h2/"])
    assert PASSWORD not in repr(options)
    assert "guest:***@localhost" in repr(options)


def test_from_strings_parses_strings_and_dotted_policy_keys() -> None:
    options = PublisherOptions.from_strings(
        URL,
        {
            "max_in_flight": " 1000 ",
            "max_in_flight_bytes": "2048",
            "heartbeat": "0",
            "delivery_timeout": "30.5",
            "publish_timeout": "5",
            "blocked_timeout": "none",
            "dedup_header": "x-dedup",
            "connection_name": "",
            "nack_policy.max_attempts": "3",
            "nack_policy.initial_delay": "0.5",
            "connect_policy.max_retries": "2",
            "connect_policy.interval_step": "1",
        },
    )
    assert (options.max_in_flight, options.max_in_flight_bytes, options.heartbeat) == (
        1000,
        2048,
        0,
    )
    assert (options.delivery_timeout, options.publish_timeout) == (30.5, 5.0)
    assert options.blocked_timeout is None
    assert (options.dedup_header, options.connection_name) == ("x-dedup", None)
    assert options.nack_policy == dataclasses.replace(
        DEFAULT_NACK_POLICY, max_attempts=3, initial_delay=0.5
    )
    assert options.connect_policy == dataclasses.replace(
        DEFAULT_CONNECT_POLICY, max_attempts=3, step=1.0, multiplier=1.0, jitter=0.0
    )
    assert PublisherOptions.from_strings(URL, {"blocked_timeout": "2.5"}).blocked_timeout == 2.5


@pytest.mark.parametrize(
    "options, named",
    [
        ({"max_in_flight": "many"}, "max_in_flight"),
        ({"heartbeat": "1.5"}, "heartbeat"),
        ({"delivery_timeout": "soon"}, "delivery_timeout"),
        ({"delivery_timeout": "inf"}, "delivery_timeout"),
        ({"nack_policy": "3"}, "nack_policy"),
        ({"nack_policy.bogus": "1"}, "bogus"),
        ({"connect_policy.max_attempts": "x"}, "max_attempts"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_from_strings_rejects_bad_strings(options: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        PublisherOptions.from_strings(URL, options)


# --- state table ----------------------------------------------------------------------------------


def test_state_machine_follows_the_table_and_reports_changes() -> None:
    changes: list[tuple[State, State]] = []
    machine = StateMachine(on_change=lambda old, new: changes.append((old, new)))
    path = [
        State.OPEN,
        State.BLOCKED,
        State.OPEN,
        State.RECOVERING,
        State.OPEN,
        State.CLOSING,
        State.CLOSED,
    ]
    assert machine.state is State.CONNECTING and not machine.writable
    for new in path:
        assert machine.transition(new) is True
        assert machine.state is new
        assert machine.writable is (new is State.OPEN)
    assert changes == list(zip([State.CONNECTING, *path[:-1]], path, strict=True))


def test_transition_to_the_current_state_is_a_no_op() -> None:
    changes: list[tuple[State, State]] = []
    machine = StateMachine(on_change=lambda old, new: changes.append((old, new)))
    assert machine.transition(State.CONNECTING) is False
    assert changes == []


_INVALID = [
    (old, new)
    for old, new in itertools.product(State, State)
    if old is not new and new not in TRANSITIONS[old]
]


@pytest.mark.parametrize("old, new", _INVALID, ids=[f"{a.value}->{b.value}" for a, b in _INVALID])
def test_invalid_transitions_are_rejected(old: State, new: State) -> None:
    changes: list[tuple[State, State]] = []
    machine = StateMachine(on_change=lambda a, b: changes.append((a, b)))
    machine._state = old  # put the machine in ``old`` without going through the listener
    with pytest.raises(InvalidTransition, match=f"{old.value} to {new.value}"):
        machine.transition(new)
    assert machine.state is old and changes == []


def test_state_table_shape() -> None:
    assert set(TRANSITIONS) == set(State)
    assert frozenset({State.OPEN}) == WRITABLE
    assert TRANSITIONS[State.CLOSED] == frozenset()
    assert {(State.OPEN, State.CONNECTING), (State.CLOSED, State.OPEN)} <= set(_INVALID)
    # every state can reach CLOSED, and every state is reachable from CONNECTING
    for start in State:
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert State.CLOSED in seen
        if start is State.CONNECTING:
            assert seen == set(State)


def test_message_properties_default_is_persistent() -> None:
    assert MessageProperties().delivery_mode == PERSISTENT


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
