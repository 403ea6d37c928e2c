"""The spool's record format: every message ``build_message`` accepts comes back equal, with
every header value of the same type; a damaged record raises CodecError, never anything else."""

from __future__ import annotations

import contextlib
import datetime as dt
import zoneinfo
from decimal import Decimal
from typing import Any, Literal

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.message import MessageProperties, OutgoingMessage, as_message
from reliable_amqp._spool._codec import CodecError, Unstorable, decode, encode


def decoded(meta: bytes, body: bytes) -> OutgoingMessage:
    """What :func:`decode` reads back, as the plain message the inspecting tools show."""
    return as_message(decode(meta, body))


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 == 1.0 == True is not enough here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dt.datetime):
        return (
            a == b and (a.tzinfo is None) == (b.tzinfo is None) and a.utcoffset() == b.utcoffset()
        )
    if isinstance(a, Decimal):
        same: bool = a.as_tuple() == b.as_tuple()
        return same
    return bool(a == b)


def _round_trip(message: OutgoingMessage) -> OutgoingMessage:
    back = decoded(encode(message), message.body)
    assert back == message
    assert back.message_id == message.message_id
    assert back.mandatory is message.mandatory
    for name in MessageProperties.__dataclass_fields__:
        assert _same(getattr(back.properties, name), getattr(message.properties, name)), name
    return back


# --- hypothesis: anything build_message accepts --------------------------------------------------

#: surrogates (typed: mypy infers tuple[str] for a bare ("Cs",), not hypothesis's category names)
_SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
_names = st.text(st.characters(blacklist_categories=_SURROGATES), max_size=20)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(blacklist_categories=_SURROGATES), max_size=30),
    st.binary(max_size=30),
    st.decimals(
        allow_nan=False, allow_infinity=False, places=3, min_value=-(10**6), max_value=10**6
    ),
    st.datetimes(min_value=dt.datetime(1971, 1, 1), max_value=dt.datetime(9998, 1, 1)),
    st.datetimes(
        min_value=dt.datetime(1971, 1, 1),
        max_value=dt.datetime(9998, 1, 1),
        timezones=st.sampled_from(
            [dt.timezone.utc, dt.timezone(dt.timedelta(hours=-5, minutes=-30))]
        ),
    ),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(_names, inner, max_size=4),
    ),
    max_leaves=12,
)
_short = st.text(st.characters(blacklist_categories=_SURROGATES), max_size=40)
_properties = st.fixed_dictionaries(
    {},
    optional={
        "content_type": _short,
        "content_encoding": _short,
        # (not CC or BCC: publish() refuses those unless lists of str)
        "headers": st.dictionaries(
            _names.filter(lambda key: key not in ("CC", "BCC")), _values, max_size=5
        ),
        "delivery_mode": st.sampled_from([1, 2]),
        "priority": st.integers(0, 255),
        "correlation_id": _short,
        "reply_to": _short.filter(lambda s: s != "amq.rabbitmq.reply-to"),
        "expiration": st.integers(0, 10**9).map(str),
        "message_id": _short.filter(bool),
        "timestamp": st.integers(0, 2**40),
        "type": _short,
        "user_id": _short,
        "app_id": _short,
    },
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    exchange=_short,
    routing_key=_short.filter(lambda s: not s.startswith("amq.rabbitmq.reply-to.")),
    body=st.binary(max_size=200),
    mandatory=st.booleans(),
    properties=_properties,
)
def test_every_valid_message_round_trips(
    exchange: str, routing_key: str, body: bytes, mandatory: bool, properties: dict[str, Any]
) -> None:
    message = build_message(exchange, routing_key, body, mandatory=mandatory, properties=properties)
    _round_trip(message)


# --- the cases the AMQP encoding would lose ------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        dt.datetime(2024, 5, 1, 12, 30, 15, 123456),  # naive, microseconds
        dt.datetime(2024, 5, 1, 12, 30, 15, tzinfo=dt.timezone.utc),
        dt.datetime(2024, 3, 31, 2, 30, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")),
        Decimal("1.50"),
        Decimal("-0.000"),
        Decimal("12345E+3"),
        (1, "a", None),
        [1, (2, 3)],
        2**63 - 1,
        -(2**63),
        -0.0,
        1e308,
        True,
        0,
        b"\x00\xff",
        "é€\U0001f600",
        {"nested": {"deeper": [1, {"x": b""}]}},
    ],
)
def test_header_types_survive(value: object) -> None:
    message = OutgoingMessage(
        "ex", "rk", b"b", MessageProperties(headers={"v": value}, message_id="m-1")
    )
    back = _round_trip(message)
    assert back.properties.headers is not None


def test_hand_made_messages_round_trip() -> None:
    for message in [
        OutgoingMessage("", "q", b""),  # no message id at all
        OutgoingMessage("x", "y", b"z", MessageProperties(delivery_mode=1), mandatory=True),
        OutgoingMessage("", "", b"", MessageProperties(priority=0)),
        OutgoingMessage("a" * 300, "b" * 70000, b"c" * 100_000, MessageProperties(message_id="i")),
        OutgoingMessage("", "q", b"", MessageProperties(timestamp=2**64 - 1, message_id="\udcff")),
    ]:
        _round_trip(message)


def test_an_empty_message_id_means_none() -> None:
    message = OutgoingMessage("", "q", b"", MessageProperties(message_id=""))
    back = decoded(encode(message), b"")
    assert back == message
    assert not back.message_id


def test_a_big_int_outside_64_bits_round_trips() -> None:
    message = OutgoingMessage("", "q", b"", MessageProperties(headers={"big": 2**100}))
    _round_trip(message)


def test_unstorable_values_are_named() -> None:
    message = OutgoingMessage("", "q", b"", MessageProperties(headers={"bad": {1, 2}}))
    with pytest.raises(Unstorable) as info:
        encode(message)
    assert "headers['bad']" in str(info.value)
    assert "set" in str(info.value)


def test_records_share_the_properties_of_equal_messages() -> None:
    first = build_message("", "q", b"1", properties={"content_type": "a/b", "headers": {"k": 1}})
    second = build_message("", "q", b"2", properties={"content_type": "a/b", "headers": {"k": 1}})
    a = decoded(encode(first), b"1")
    b = decoded(encode(second), b"2")
    assert a.properties.headers == b.properties.headers == {"k": 1}
    assert a.message_id != b.message_id


def test_records_in_a_row_decode_alike_by_the_short_way_and_the_whole() -> None:
    """A record that starts as the one decoded before (same route, same properties) has only
    its id read: it must come back exactly as one decoded whole would."""
    props = {"content_type": "a/b", "headers": {"k": [1, "x"]}}
    made = [
        build_message("ex", "rk", b"1", properties={**props, "message_id": "a"}),
        build_message("ex", "rk", b"2", properties={**props, "message_id": "é" * 40}),
        build_message("ex", "rk", b"3", properties={**props, "message_id": "b" * 255}),
        build_message("ex", "other", b"4", properties={**props, "message_id": "c"}),
        build_message("ex", "rk", b"5", properties={**props, "message_id": "d"}),
        build_message("ex", "rk", b"6", properties={"message_id": "e"}),
        build_message("ex", "rk", b"7", properties={**props, "message_id": "f"}),
    ]
    records = [encode(m) for m in made]
    for message, record in zip(made, records, strict=True):
        got = decoded(record, message.body)
        assert _same(got.properties, message.properties) and got == message
    # the same start with a damaged id (bytes that are no UTF-8), or a wrong length, is refused
    decoded(records[0], b"1")
    with pytest.raises(CodecError):
        decoded(records[0][:-1] + b"\xff", b"1")
    with pytest.raises(CodecError):
        decoded(records[0] + b"x", b"1")


# --- damage --------------------------------------------------------------------------------------


def test_truncated_or_extended_records_are_refused() -> None:
    record = encode(
        build_message("ex", "rk", b"b", properties={"headers": {"a": [1, 2]}, "priority": 1})
    )
    for cut in range(len(record)):
        with pytest.raises(CodecError):
            decoded(record[:cut], b"b")
    with pytest.raises(CodecError):
        decoded(record + b"\x00", b"b")


def test_an_unknown_format_is_named() -> None:
    record = bytearray(encode(build_message("", "q", b"")))
    record[0] = 9
    with pytest.raises(CodecError, match="unknown record format 9"):
        decoded(bytes(record), b"")


@settings(max_examples=300)
@given(data=st.data())
def test_flipped_bytes_raise_codec_error_or_decode(data: st.DataObject) -> None:
    record = bytearray(
        encode(
            build_message(
                "ex",
                "rk",
                b"b",
                properties={
                    "headers": {"a": [1, "x", {"b": Decimal("1.5")}]},
                    "app_id": "z",
                    "message_id": "fixed",
                },
            )
        )
    )
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(record) - 1))
        record[at] = data.draw(st.integers(0, 255))
    with contextlib.suppress(CodecError):
        decoded(bytes(record), b"b")
