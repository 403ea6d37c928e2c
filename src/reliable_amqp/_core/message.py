"""Messages as the library holds them, and the checks that run before anything is sent.

``build_message`` turns what a caller hands to ``publish()`` into an :class:`OutgoingMessage` or
raises :class:`~reliable_amqp.InvalidMessage` naming the field; a bad message therefore never
reaches the wire, where it would close the channel under every other message in flight.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import dataclasses
import datetime as _dt
import itertools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from reliable_amqp._core.errors import InvalidMessage

#: AMQP ``shortstr`` limit, which bounds exchange names, routing keys and string properties.
SHORTSTR_MAX = 255
_INT64 = (-(2**63), 2**63 - 1)
_NESTING_MAX = 32
_YEAR_10000 = 253_402_300_800  # POSIX seconds of 10000-01-01T00:00Z
#: RabbitMQ refuses a per-message TTL over ten years (406 "invalid expiration", value_too_large)
EXPIRATION_MAX = 315_360_000_000
#: Direct reply-to (RabbitMQ): a ``reply_to`` naming the pseudo-queue needs a consumer on it on
#: the publishing channel, which a publisher never has (406 "fast reply consumer does not
#: exist"); a routing key under the prefix, on the default exchange, is an address the broker
#: decodes, and one it cannot decode closes the whole connection (541 INTERNAL_ERROR, 3.10)
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
_REPLY_TO_PREFIX = DIRECT_REPLY_TO + "."
#: headers RabbitMQ reads as extra routing keys (sender-selected distribution): an array, or the
#: broker closes the channel (406 unacceptable_type_in_header)
_ROUTING_HEADERS = ("CC", "BCC")

#: AMQP 0-9-1 basic properties, in the order of their flag bits (bit 15 first)
PROPERTY_ORDER = (
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)
#: Basic properties a caller may pass as keywords to ``publish()`` (AMQP 0-9-1 names).
PROPERTY_NAMES: frozenset[str] = frozenset(PROPERTY_ORDER)
_SHORTSTR_PROPERTIES = (
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
)

PERSISTENT = 2
TRANSIENT = 1


@dataclass(frozen=True, slots=True)
class MessageProperties:
    """AMQP basic properties of a message (``None`` means "not set")."""

    content_type: str | None = None
    content_encoding: str | None = None
    headers: Mapping[str, Any] | None = None
    delivery_mode: int = PERSISTENT
    priority: int | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    expiration: str | None = None
    message_id: str | None = None
    timestamp: int | None = None
    type: str | None = None
    user_id: str | None = None
    app_id: str | None = None


#: The properties of a message given none: persistent, nothing else (its id is the message's).
DEFAULT_BASE = MessageProperties()


class OutgoingMessage:
    """One message as accepted by a publisher; it stays the same across republishes.

    ``OutgoingMessage(exchange, routing_key, body, properties, mandatory)``, immutable. Held as
    the properties without the id (``base``, shared by every message published with the same
    properties) plus ``message_id``: a publish then builds no properties object of its own, and
    the frames of a ``base`` are encoded once. ``properties`` (with the id) is built on first use.
    """

    __slots__ = (
        "_properties",
        "base",
        "body",
        "exchange",
        "mandatory",
        "message_id",
        "routing_key",
    )

    exchange: str
    routing_key: str
    body: bytes
    mandatory: bool
    #: the stable id consumers use to drop duplicates (generated when none was given; "" when a
    #: message was built by hand without one)
    message_id: str
    #: the properties without ``message_id`` (shared between messages)
    base: MessageProperties
    _properties: MessageProperties | None

    def __init__(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: MessageProperties | None = None,
        mandatory: bool = False,
    ) -> None:
        props = DEFAULT_BASE if properties is None else properties
        base = props if props.message_id is None else _without_id(props)
        _init_message(self, exchange, routing_key, body, base, mandatory, props.message_id or "")
        _set_cached_properties(self, props)

    @property
    def properties(self) -> MessageProperties:
        """The AMQP basic properties, ``message_id`` included."""
        props = self._properties
        if props is None:
            props = self.base
            if self.message_id:
                props = _with_id(props, self.message_id)
            _set_cached_properties(self, props)
        return props

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OutgoingMessage):
            return NotImplemented
        return (
            self.exchange == other.exchange
            and self.routing_key == other.routing_key
            and self.body == other.body
            and self.mandatory == other.mandatory
            and self.message_id == other.message_id
            and self.base == other.base
        )

    def __hash__(self) -> int:
        return hash((self.exchange, self.routing_key, self.body, self.message_id))

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            OutgoingMessage,
            (self.exchange, self.routing_key, self.body, self.properties, self.mandatory),
        )

    def plain(self) -> OutgoingMessage:
        """This message as a plain :class:`OutgoingMessage` (itself, unless it is a subclass,
        such as the publisher's bookkeeping entry)."""
        if type(self) is OutgoingMessage:
            return self
        message = new_outgoing(
            self.exchange, self.routing_key, self.body, self.base, self.mandatory, self.message_id
        )
        return message

    def replace(self, **changes: Any) -> OutgoingMessage:
        """A copy with some of the constructor's arguments changed."""
        args: dict[str, Any] = {
            "exchange": self.exchange,
            "routing_key": self.routing_key,
            "body": self.body,
            "properties": self.properties,
            "mandatory": self.mandatory,
        }
        args.update(changes)
        return OutgoingMessage(**args)

    def __repr__(self) -> str:
        return (
            f"OutgoingMessage(exchange={self.exchange!r}, routing_key={self.routing_key!r}, "
            f"message_id={self.message_id!r}, body=<{len(self.body)} bytes>, "
            f"mandatory={self.mandatory})"
        )


def _without_id(props: MessageProperties) -> MessageProperties:
    return dataclasses.replace(props, message_id=None)


def _with_id(props: MessageProperties, message_id: str) -> MessageProperties:
    return dataclasses.replace(props, message_id=message_id)


@dataclass(frozen=True, slots=True)
class Confirmation:
    """What a successful publish resolves to: the broker confirmed the message."""

    message_id: str
    attempts: int


# A random 64-bit prefix per process plus a counter: unique like a uuid4, ten times cheaper
# (ids are minted on the hot path of every publish). Re-seeded in forked children.
_id_prefix = os.urandom(8).hex()
_id_counter = itertools.count(1)


def _reseed_ids() -> None:
    global _id_prefix, _id_counter  # noqa: PLW0603  (a forked child must not repeat ids)
    _id_prefix = os.urandom(8).hex()
    _id_counter = itertools.count(1)


os.register_at_fork(after_in_child=_reseed_ids)


def new_message_id() -> str:
    """A fresh unique message id: 16 random hex digits, a dash and a hex counter."""
    return f"{_id_prefix}-{next(_id_counter):x}"


def new_message_ids(count: int) -> list[str]:
    """``count`` fresh ids, as :func:`new_message_id` makes them, in one call."""
    prefix = _id_prefix + "-"
    return [f"{prefix}{n:x}" for n in itertools.islice(_id_counter, count)]


# The hot path builds its two frozen dataclasses through their slot descriptors: a frozen
# dataclass's __init__ sets every field with object.__setattr__, which made building them the
# largest single cost of publish() (2.5x this way). Same classes, same objects: still frozen,
# equal to what the constructors build (tests/core checks).
_new = object.__new__


def _slot_setter(cls: type, name: str) -> Callable[[object, Any], None]:
    setter: Callable[[object, Any], None] = getattr(cls, name).__set__
    return setter


_set_exchange = _slot_setter(OutgoingMessage, "exchange")
_set_routing_key = _slot_setter(OutgoingMessage, "routing_key")
_set_body = _slot_setter(OutgoingMessage, "body")
_set_base = _slot_setter(OutgoingMessage, "base")
_set_mandatory = _slot_setter(OutgoingMessage, "mandatory")
_set_message_id = _slot_setter(OutgoingMessage, "message_id")
_set_cached_properties = _slot_setter(OutgoingMessage, "_properties")


def _init_message(  # noqa: PLR0917
    message: OutgoingMessage,
    exchange: str,
    routing_key: str,
    body: bytes,
    base: MessageProperties,
    mandatory: bool,
    message_id: str,
) -> None:
    """Set a message's fields through their slots (no ``properties`` built yet): for
    ``OutgoingMessage`` and the subclasses the hot path builds (engine entries, sync futures)."""
    _set_exchange(message, exchange)
    _set_routing_key(message, routing_key)
    _set_body(message, body)
    _set_base(message, base)
    _set_mandatory(message, mandatory)
    _set_message_id(message, message_id)
    _set_cached_properties(message, None)


def new_outgoing(  # noqa: PLR0917
    exchange: str,
    routing_key: str,
    body: bytes,
    base: MessageProperties,
    mandatory: bool,
    message_id: str,
) -> OutgoingMessage:
    """An :class:`OutgoingMessage` from checked parts, built fast (``base`` has no id)."""
    message: OutgoingMessage = _new(OutgoingMessage)
    _init_message(message, exchange, routing_key, body, base, mandatory, message_id)
    return message


_set_confirmed_id = _slot_setter(Confirmation, "message_id")
_set_attempts = _slot_setter(Confirmation, "attempts")


def new_confirmation(message_id: str, attempts: int) -> Confirmation:
    """``Confirmation(message_id, attempts)``, built fast (one per confirmed message)."""
    confirmation: Confirmation = _new(Confirmation)
    _set_confirmed_id(confirmation, message_id)
    _set_attempts(confirmation, attempts)
    return confirmation


def build_message(
    exchange: object,
    routing_key: object,
    body: object,
    *,
    mandatory: bool = False,
    properties: Mapping[str, Any] | None = None,
) -> OutgoingMessage:
    """Validate what a caller gave ``publish()`` and return the message to send.

    Raises :class:`InvalidMessage` naming the field for anything AMQP cannot carry: a body that is
    not bytes-like, a name over 255 bytes, an unknown property, a header value with no AMQP type.
    """
    check_route(exchange, routing_key)
    assert isinstance(exchange, str) and isinstance(routing_key, str)
    data = check_body(body)
    check_mandatory(mandatory)
    if not properties:
        return new_outgoing(exchange, routing_key, data, DEFAULT_BASE, mandatory, new_message_id())
    given = dict(properties)
    message_id = check_message_id(given.pop("message_id", None))
    base = build_base(given)
    return new_outgoing(
        exchange, routing_key, data, base, mandatory, message_id or new_message_id()
    )


def check_route(exchange: object, routing_key: object) -> None:
    """Raise :class:`InvalidMessage` unless ``exchange`` and ``routing_key`` can be sent."""
    _check_shortstr("exchange", exchange)
    _check_shortstr("routing_key", routing_key)
    assert isinstance(exchange, str) and isinstance(routing_key, str)
    if not exchange and routing_key.startswith(_REPLY_TO_PREFIX):
        _check_reply_address(routing_key)


def check_body(body: object) -> bytes:
    """``body`` as bytes; :class:`InvalidMessage` when it is not bytes-like."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    raise InvalidMessage(
        "body",
        f"must be bytes, bytearray or memoryview, not {type(body).__name__}"
        + (" (encode str bodies first, e.g. body.encode())" if isinstance(body, str) else ""),
    )


def check_mandatory(mandatory: object) -> None:
    """Raise :class:`InvalidMessage` unless ``mandatory`` is a bool."""
    if mandatory is not True and mandatory is not False:
        raise InvalidMessage("mandatory", f"must be a bool, not {type(mandatory).__name__}")


def check_message_id(message_id: object) -> str | None:
    """A caller's ``message_id`` checked (None: generate one)."""
    if message_id is None:
        return None
    _check_shortstr("message_id", message_id)
    assert isinstance(message_id, str)
    if not message_id:
        raise InvalidMessage("message_id", "must not be empty")
    return message_id


def build_base(given: Mapping[str, Any]) -> MessageProperties:
    """Checked properties other than ``message_id`` (which must not be among ``given``)."""
    if not given:
        return DEFAULT_BASE
    unknown = sorted(set(given) - _BASE_NAMES)
    if unknown:
        raise InvalidMessage(
            unknown[0],
            f"is not an AMQP basic property (known: {', '.join(sorted(PROPERTY_NAMES))})",
        )
    values = {k: v for k, v in given.items() if v is not None}
    for name in _SHORTSTR_PROPERTIES:
        if name in values:
            if (
                name == "expiration"
                and isinstance(values[name], int)
                and not isinstance(values[name], bool)
            ):
                values[name] = str(values[name])
            _check_shortstr(name, values[name])
    expiration = values.get("expiration")
    if expiration is not None:
        if not (expiration.isascii() and expiration.isdigit()):
            raise InvalidMessage(
                "expiration",
                f"must be a non-negative whole number of milliseconds, got {expiration!r}",
            )
        if int(expiration) > EXPIRATION_MAX:
            raise InvalidMessage(
                "expiration",
                f"{expiration} ms is over the broker's limit of {EXPIRATION_MAX} (ten years)",
            )
    if values.get("reply_to") == DIRECT_REPLY_TO:
        raise InvalidMessage(
            "reply_to",
            f"{DIRECT_REPLY_TO!r} needs a consumer of it on the publishing channel, which a "
            "publisher does not have (the broker would close the channel)",
        )
    mode = values.get("delivery_mode", PERSISTENT)
    if type(mode) is not int or mode not in (TRANSIENT, PERSISTENT):
        raise InvalidMessage(
            "delivery_mode",
            f"must be 1 (transient) or 2 (persistent), got {values['delivery_mode']!r}",
        )
    if "priority" in values:
        p = values["priority"]
        if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p <= 255:
            raise InvalidMessage("priority", f"must be an int from 0 to 255, got {p!r}")
    if "timestamp" in values:
        values["timestamp"] = _timestamp(values["timestamp"])
    if "headers" in values:
        headers = values["headers"]
        if not isinstance(headers, Mapping):
            raise InvalidMessage("headers", f"must be a mapping, not {type(headers).__name__}")
        checked = _check_table("headers", headers, 0)
        for name in _ROUTING_HEADERS:
            if name in checked:
                _check_routing_header(name, checked[name])
        values["headers"] = checked
    if not values or values == {"delivery_mode": PERSISTENT}:
        return DEFAULT_BASE
    return MessageProperties(**values)


_BASE_NAMES = PROPERTY_NAMES - {"message_id"}


def _check_routing_header(name: str, value: object) -> None:
    if not isinstance(value, list) or not all(isinstance(key, str) for key in value):
        raise InvalidMessage(
            f"headers[{name!r}]",
            "RabbitMQ routes on this header: it must be a list of routing keys (str), "
            "or the broker closes the channel",
        )


def _check_reply_address(routing_key: str) -> None:
    """A direct reply-to address must be one the broker can decode (``<pid>.<key>``, base64).

    The broker splits the suffix at dots (empty parts dropped): other than two parts is merely
    unroutable, but two parts whose first is not an Erlang pid term close the connection.
    """
    parts = [part for part in routing_key[len(_REPLY_TO_PREFIX) :].split(".") if part]
    if len(parts) != 2:
        return
    try:
        term = base64.b64decode(parts[0], validate=True)
    except (binascii.Error, ValueError):
        term = b""
    if not _is_pid_term(term):
        raise InvalidMessage(
            "routing_key",
            f"{routing_key!r} is not a direct reply-to address the broker issued (the broker "
            "would close the connection decoding it)",
        )


def _is_pid_term(term: bytes) -> bool:
    """Whether ``term`` is an Erlang external-format pid (PID_EXT or NEW_PID_EXT), exactly."""
    if len(term) < 4 or term[0] != 131 or term[1] not in (88, 103):  # 131 version, 'X', 'g'
        return False
    tag, at = term[2], 3
    if tag in (100, 118):  # ATOM_EXT, ATOM_UTF8_EXT: u16 length
        if len(term) < 5:
            return False
        size, at = int.from_bytes(term[3:5], "big"), 5
    elif tag in (115, 119):  # SMALL_ATOM_EXT, SMALL_ATOM_UTF8_EXT: u8 length
        size, at = term[3], 4
    else:
        return False
    tail = 12 if term[1] == 88 else 9  # id, serial, creation (u32 or u8)
    return len(term) == at + size + tail


def _timestamp(value: object) -> int:
    if isinstance(value, _dt.datetime):
        seconds = _epoch_seconds(value)
        if seconds < 0:
            raise InvalidMessage("timestamp", f"{value} is before 1970; AMQP timestamps are u64")
        if seconds >= _YEAR_10000:
            raise InvalidMessage("timestamp", f"{value} is after 9999-12-31 in UTC")
        return seconds
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64:
        return value
    raise InvalidMessage(
        "timestamp", f"must be a datetime or POSIX seconds as an int, got {value!r}"
    )


def shortstr_problem(value: str) -> str | None:
    """Why ``value`` cannot be an AMQP ``shortstr`` (too long, or not UTF-8), or None if it can.

    Messages (``publish()``) and topology declarations check names with it.
    """
    if value.isascii() and len(value) <= SHORTSTR_MAX:  # the usual case, without encoding
        return None
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return _not_utf8(value, exc)
    if size > SHORTSTR_MAX:
        return f"is {size} bytes long; AMQP allows at most {SHORTSTR_MAX}"
    return None


def _check_shortstr(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidMessage(name, f"must be a str, not {type(value).__name__}")
    problem = shortstr_problem(value)
    if problem is not None:
        raise InvalidMessage(name, problem)


def _not_utf8(value: str, exc: UnicodeEncodeError) -> str:
    return (
        f"is not valid Unicode text: {value[exc.start : exc.end]!r} at position {exc.start} "
        "cannot be encoded as UTF-8 (a lone surrogate)"
    )


def _utf8(name: str, value: str) -> bytes:
    """``value`` as UTF-8; a string UTF-8 cannot carry (a lone surrogate) is rejected here."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessage(name, _not_utf8(value, exc)) from None


def _epoch_seconds(value: _dt.datetime) -> int:
    """Whole POSIX seconds (rounded down, as the encoder writes them); naive means UTC."""
    try:
        # utctimetuple: what the encoder uses; naive datetimes are taken as UTC
        return calendar.timegm(value.utctimetuple())
    except OverflowError:  # year 1 or 9999 moved past the calendar by its UTC offset
        return -1 if value.year == _dt.MINYEAR else 2**64


def _check_table(path: str, table: Mapping[Any, Any], depth: int) -> dict[str, Any]:
    """Check a field table; return it as a plain dict with tuples made lists (as encoders want)."""
    checked: dict[str, Any] = {}
    for key, value in table.items():
        if not isinstance(key, str):
            raise InvalidMessage(f"{path}[{key!r}]", "field table keys must be str")
        problem = shortstr_problem(key)
        if problem is not None:
            raise InvalidMessage(f"{path}[{key!r}]", f"key {problem}")
        checked[key] = _check_value(f"{path}[{key!r}]", value, depth + 1)
    return checked


def _check_value(path: str, value: object, depth: int) -> Any:
    if depth > _NESTING_MAX:
        raise InvalidMessage(path, f"nested deeper than {_NESTING_MAX} levels")
    if isinstance(value, str):
        if not value.isascii():
            _utf8(path, value)
        return value
    if value is None or isinstance(value, (bool, bytes)):
        return value
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise InvalidMessage(path, f"int {value} does not fit AMQP's signed 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessage(path, f"{value} is not a finite number")
        return value
    if isinstance(value, Decimal):
        _check_decimal(path, value)
        return value
    if isinstance(value, _dt.datetime):
        seconds = _epoch_seconds(value)
        if seconds < 0:
            raise InvalidMessage(path, f"{value} is before 1970; AMQP timestamps are u64")
        if seconds >= _YEAR_10000:
            raise InvalidMessage(path, f"{value} is after 9999-12-31 in UTC")
        return value
    if isinstance(value, Mapping):
        return _check_table(path, value, depth)
    if isinstance(value, (list, tuple)):
        return [_check_value(f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value)]
    raise InvalidMessage(
        path,
        f"a {type(value).__name__} has no AMQP field type (use str, bytes, int, float, bool, "
        "Decimal, datetime, None, list or dict)",
    )


def _check_decimal(path: str, value: Decimal) -> None:
    decimal_parts(path, value)


#: AMQP's decimal holds a signed 32-bit value: at most 10 digits
_DECIMAL_DIGITS = 10


def decimal_parts(path: str, value: Decimal) -> tuple[int, int]:
    """AMQP's decimal for ``value``: (scale octet, signed 32-bit value), value / 10**scale.

    Works on the digit tuple alone, so a huge exponent (``Decimal('1E+1000000')``) is refused at
    once instead of being expanded (or overflowing the decimal context). Raises
    :class:`InvalidMessage` naming ``path`` when AMQP cannot hold it.
    """
    if not value.is_finite():
        raise InvalidMessage(path, f"Decimal {value} is not finite")
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    if not any(digits):
        return 0, 0  # any zero (0.000, -0) is 0 with scale 0, as pika writes it
    end = len(digits)
    while end > 1 and digits[end - 1] == 0 and exponent < 0:  # 1.500 -> 1.5: drop zeros
        end -= 1
        exponent += 1
    while end > 1 and digits[0] == 0:
        digits = digits[1:]
        end -= 1
    width = end + max(exponent, 0)  # digits of the scaled integer
    scale = max(0, -exponent)
    if width > _DECIMAL_DIGITS or scale > 255:
        raise InvalidMessage(
            path, f"Decimal {value} does not fit AMQP's decimal (32-bit digits, scale up to 255)"
        )
    raw = int("".join(map(str, digits[:end]))) * 10 ** max(exponent, 0)
    if sign:
        raw = -raw
    if not -(2**31) <= raw < 2**31:
        raise InvalidMessage(
            path, f"Decimal {value} does not fit AMQP's decimal (32-bit digits, scale up to 255)"
        )
    return scale, raw
