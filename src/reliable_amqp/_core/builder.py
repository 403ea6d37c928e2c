"""The one place a message is built from what a caller gives: checked, or refused with
:class:`~reliable_amqp.InvalidMessage` naming the field.

A bad message never reaches the wire, where it would close the channel under every other
message in flight. :func:`build_message` checks one message on its own; a publisher's
:class:`MessageBuilder` does the same with caches (routes and property sets already checked)
and the checks that depend on the publisher (the broker's ``frame_max``, the user it connects
as), for ``publish()``, ``publish_many()`` and ``publish_message()`` alike.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import datetime as _dt
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from decimal import Decimal
from functools import partial
from typing import Any, Generic, Protocol, TypeVar, cast

from reliable_amqp._core.brokers import RABBITMQ_EXPIRATION_MAX, BrokerLimits
from reliable_amqp._core.errors import InvalidMessage, a_type
from reliable_amqp._core.frames import (
    decimal_parts,
    encode_table,
    header_frame_size,
    header_too_large,
)
from reliable_amqp._core.message import (
    DEFAULT_BASE,
    PERSISTENT,
    PROPERTY_NAMES,
    PROPERTY_ORDER,
    TRANSIENT,
    MessageProperties,
    OutgoingMessage,
    checked,
    new_message_ids,
    new_outgoing,
)

#: ids a builder takes for ``publish()`` are minted this many at a time (``new_message_ids``: a
#: third of the cost of one ``new_message_id()`` call each; docs/benchmarks.md)
ID_BLOCK = 256
_minted: Iterator[str] = iter(())


def _reset_minted() -> None:
    global _minted  # noqa: PLW0603  (a forked child must not use the parent's ids)
    _minted = iter(())


# registered after message.py's reseed (imported above): a child mints from its own prefix
os.register_at_fork(after_in_child=_reset_minted)


def next_message_id() -> str:
    """A fresh unique id, as :func:`~reliable_amqp._core.message.new_message_id` makes them,
    taken from a block minted in one call. Thread-safe: ``next`` on the block is atomic, and
    two threads that find it empty at once each mint a block of their own (ids left unused
    are never minted again)."""
    global _minted  # noqa: PLW0603
    message_id = next(_minted, None)
    if message_id is None:
        block = iter(new_message_ids(ID_BLOCK))
        message_id = next(block)
        _minted = block
    return message_id


#: AMQP ``shortstr`` limit, which bounds exchange names, routing keys and string properties.
SHORTSTR_MAX = 255
_INT64 = (-(2**63), 2**63 - 1)
_NESTING_MAX = 32
_YEAR_10000 = 253_402_300_800  # POSIX seconds of 10000-01-01T00:00Z
#: no broker takes a per-message TTL over ten years (RabbitMQ: 406 "invalid expiration",
#: value_too_large); tighter limits of one broker are in ``_core.brokers``
EXPIRATION_MAX = RABBITMQ_EXPIRATION_MAX
#: Direct reply-to (RabbitMQ): a ``reply_to`` naming the pseudo-queue needs a consumer on it on
#: the publishing channel, which a publisher never has (406 "fast reply consumer does not
#: exist"); a routing key under the prefix, on the default exchange, is an address the broker
#: decodes, and one it cannot decode closes the whole connection (541 INTERNAL_ERROR, 3.10)
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
_REPLY_TO_PREFIX = DIRECT_REPLY_TO + "."
#: headers RabbitMQ reads as extra routing keys (sender-selected distribution): an array, or the
#: broker closes the channel (406 unacceptable_type_in_header)
_ROUTING_HEADERS = ("CC", "BCC")

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


def build_message(
    exchange: object,
    routing_key: object,
    body: object,
    *,
    mandatory: bool = False,
    properties: Mapping[str, Any] | None = None,
) -> OutgoingMessage:
    """Check what a caller gives ``publish()`` and return the message to send, on its own (no
    publisher: nothing checked against a broker's ``frame_max`` or a user).

    Raises :class:`InvalidMessage` naming the field for anything AMQP cannot carry: a body that is
    not bytes-like, a name over 255 bytes, an unknown property, a header value with no AMQP type.
    """
    check_mandatory(mandatory)
    given = dict(properties) if properties else {}
    # checked there whatever their types (a caller's values are not always what the API says)
    return _PLAIN.message(
        cast(str, exchange), cast(str, routing_key), cast(bytes, body), mandatory, given
    )


def message_arguments(message: OutgoingMessage) -> tuple[str, str, bytes, bool, dict[str, Any]]:
    """What ``publish()`` takes to send ``message``: (exchange, routing key, body, mandatory,
    the properties it sets as keywords, its ``message_id`` among them when it has one)."""
    base = message.base
    given = {name: value for name in PROPERTY_ORDER if (value := getattr(base, name)) is not None}
    if given.get("delivery_mode") == PERSISTENT:
        del given["delivery_mode"]  # the default
    if message.message_id:
        given["message_id"] = message.message_id
    return message.exchange, message.routing_key, message.body, message.mandatory, given


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
        f"{a_type(value)} has no AMQP field type (use str, bytes, int, float, bool, "
        "Decimal, datetime, None, list or dict)",
    )


def _check_decimal(path: str, value: Decimal) -> None:
    decimal_parts(path, value)


#: what the properties other than headers can take in a content-header frame, at most (12
#: shortstrs, a timestamp, two octets, flags, the frame's own bytes): below that, no check
_OTHER_PROPERTIES_MAX = 4096
#: the attempt header the engine adds to a mandatory message, at most
_ENGINE_HEADERS_MAX = 96
#: routes and property sets remembered as checked, per publisher (then forgotten at once)
_CACHE_MAX = 1024


def _ids(given: Iterable[str], count: int) -> list[str]:
    """The caller's ``message_ids`` for ``count`` bodies, every one checked."""
    if isinstance(given, (str, bytes)):
        raise InvalidMessage(
            "message_ids", f"must be an iterable of ids, not one {type(given).__name__}"
        )
    try:
        ids = list(given)
    except TypeError:
        raise InvalidMessage(
            "message_ids", f"must be an iterable of ids, not {type(given).__name__}"
        ) from None
    if len(ids) != count:
        raise InvalidMessage("message_ids", f"has {len(ids)} ids for {count} bodies: give one each")
    for i, message_id in enumerate(ids):
        if message_id is None:
            raise InvalidMessage(f"message_ids[{i}]", "is None: give every message its id")
        try:
            check_message_id(message_id)
        except InvalidMessage as exc:
            raise InvalidMessage(f"message_ids[{i}]", exc.problem) from None
    return ids


class Limits(Protocol):
    """What bounds a message on the connection (the supervisor): 0 until connected."""

    @property
    def frame_max(self) -> int:
        """The largest frame the broker takes, in bytes (0: not known yet)."""
        ...

    @property
    def broker(self) -> BrokerLimits:
        """The connected (or last connected) broker's own limits (``ANY_BROKER``: not known)."""
        ...


M = TypeVar("M")  # what a builder makes: an OutgoingMessage, or a publisher's in-flight entry


class MessageBuilder(Generic[M]):
    """The messages of one publisher, from what its caller gives (``publish()``,
    ``publish_many()``, ``publish_message()``), checked as :func:`build_message` checks and
    made by ``new`` (the publisher's in-flight type) from the checked parts.

    Beyond what each field admits: the headers must encode (checked here, not on the I/O side
    mid-batch), the content header must fit the broker's ``frame_max`` once ``limits`` knows it
    (a larger one makes the broker close the whole connection), ``expiration`` must be one the
    connected broker takes (LavinMQ's is lower than RabbitMQ's: ``_core.brokers``), and
    ``user_id`` must be one of ``users`` (the broker closes the channel otherwise). Routes and
    property sets already checked are remembered (up to 1,024 of each), so a publish of the
    same kind again checks only its body and id.
    """

    def __init__(
        self,
        new: Callable[[str, str, bytes, MessageProperties, bool, str], M],
        *,
        mandatory: bool = False,
        limits: Limits | None = None,
        users: Collection[str] | None = None,
        dedup_header: str | None = None,
    ) -> None:
        self._new = new
        #: what ``mandatory=None`` means (a publisher's ``mandatory`` option)
        self.mandatory = mandatory
        self._limits = limits
        self._users = None if users is None else frozenset(users)
        self._dedup_header = dedup_header
        #: routes (exchange, routing key) already checked
        self._routes: set[tuple[str, str]] = set()
        #: checked properties (their message_id aside) by the keywords that gave them
        self._bases: dict[tuple[tuple[str, Any], ...], MessageProperties] = {}

    def make_with(self, new: Callable[[str, str, bytes, MessageProperties, bool, str], M]) -> None:
        """From now on, make messages with ``new`` (the async publisher's, once its event loop
        is known: its futures are its entries)."""
        self._new = new

    def message(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        mandatory: bool | None,
        properties: dict[str, Any],
    ) -> M:
        """One checked message (raises :class:`InvalidMessage` naming what is wrong).

        ``properties`` is the caller's keywords dict, ``message_id`` among them (this call's
        own: it is consumed); ``mandatory`` None means the builder's default.
        """
        try:  # the usual case in line: a route checked before, the default mandatory flag
            usual = mandatory is None and (exchange, routing_key) in self._routes
        except TypeError:  # unhashable: refused by the check
            usual = False
        mandatory = (
            self.mandatory if usual else self._check_shared(exchange, routing_key, mandatory)
        )
        if type(body) is not bytes:
            body = check_body(body)
        if not properties:
            message_id = next(_minted, None) or next_message_id()
            return self._new(exchange, routing_key, body, DEFAULT_BASE, mandatory, message_id)
        message_id = check_message_id(properties.pop("message_id", None)) or next_message_id()
        base = self._base(properties) if properties else DEFAULT_BASE
        if base.expiration is not None and self._limits is not None:
            self._check_expiration(base.expiration)
        message = self._new(exchange, routing_key, body, base, mandatory, message_id)
        if base.headers and self._limits is not None and self._limits.frame_max:
            self._check_header_size(base, message_id)
        return message

    def messages(  # noqa: PLR0917
        self,
        exchange: str,
        routing_key: str,
        bodies: Iterable[bytes],
        mandatory: bool | None,
        properties: dict[str, Any],
        message_ids: Iterable[str] | None,
    ) -> list[M]:
        """The checked messages of a ``publish_many()`` call: the shared arguments checked
        once, every body (and every given id) checked before any message is built."""
        mandatory = self._check_shared(exchange, routing_key, mandatory)
        if "message_id" in properties:
            raise InvalidMessage(
                "message_id",
                "publish_many() gives every message its own id: pass message_ids=[...], one "
                "per body, for ids of your own",
            )
        if isinstance(bodies, (bytes, bytearray, memoryview, str)):
            raise InvalidMessage(
                "bodies", f"must be an iterable of bodies, not one {type(bodies).__name__}"
            )
        try:
            data = list(bodies)
        except TypeError:
            raise InvalidMessage(
                "bodies", f"must be an iterable of bodies, not {type(bodies).__name__}"
            ) from None
        for i, body in enumerate(data):
            if type(body) is not bytes:
                try:
                    data[i] = check_body(body)
                except InvalidMessage as exc:
                    raise InvalidMessage(f"bodies[{i}]", exc.problem) from None
        ids = new_message_ids(len(data)) if message_ids is None else _ids(message_ids, len(data))
        base = self._base(properties) if properties else DEFAULT_BASE
        if base.expiration is not None and self._limits is not None:
            self._check_expiration(base.expiration)
        new = self._new
        messages = [
            new(exchange, routing_key, body, base, mandatory, message_id)
            for body, message_id in zip(data, ids, strict=True)
        ]
        if base.headers and self._limits is not None and self._limits.frame_max and ids:
            # the longest id makes the largest header (a generated one: the last)
            longest = ids[-1] if message_ids is None else max(ids, key=_utf8_length)
            self._check_header_size(base, longest)
        return messages

    def from_message(self, message: OutgoingMessage) -> M:
        """``message``, made beforehand (``publish_message()``), as this builder's kind:
        checked as :meth:`message` checks a ``publish()`` call's arguments, its id kept (one
        is generated when it has none). One :func:`build_message` made is checked already:
        only what depends on the publisher (``user_id``, the header size) is checked again."""
        if not isinstance(message, OutgoingMessage):
            raise InvalidMessage(
                "message", f"must be an OutgoingMessage, not {type(message).__name__}"
            )
        if not checked(message):
            exchange, routing_key, body, mandatory, given = message_arguments(message)
            return self.message(exchange, routing_key, body, mandatory, given)
        base = message.base
        if base.user_id is not None:
            self._check_user(base.user_id)
        if base.expiration is not None and self._limits is not None:
            self._check_expiration(base.expiration)
        message_id = message.message_id or next_message_id()
        made = self._new(
            message.exchange, message.routing_key, message.body, base, message.mandatory, message_id
        )
        if base.headers and self._limits is not None and self._limits.frame_max:
            self._check_header_size(base, message_id)
        return made

    def _check_shared(self, exchange: str, routing_key: str, mandatory: bool | None) -> bool:
        """Check what every message of a call shares: the route (once per publisher), and
        ``mandatory``; the mandatory flag to use (None: the builder's default)."""
        try:
            known = (exchange, routing_key) in self._routes
        except TypeError:  # unhashable: refused by the check
            known = False
        if not known:
            self._check_route(exchange, routing_key)
        if mandatory is None:
            return self.mandatory
        if mandatory is not False and mandatory is not True:
            check_mandatory(mandatory)
        return mandatory

    def _check_route(self, exchange: str, routing_key: str) -> None:
        check_route(exchange, routing_key)
        routes = self._routes
        if len(routes) >= _CACHE_MAX:
            routes.clear()
        routes.add((exchange, routing_key))

    def _base(self, given: dict[str, Any]) -> MessageProperties:
        """Checked properties for the keywords ``given`` (no message_id), cached when every
        value is a str or an int (not a bool: it would equal 1 in the key)."""
        key: tuple[tuple[str, Any], ...] | None = None
        for value in given.values():
            kind = type(value)
            if kind is not str and kind is not int and value is not None:
                break
        else:
            key = tuple(given.items())
            base = self._bases.get(key)
            if base is not None:
                return base
        base = build_base(given)
        if base.headers:
            encode_table(base.headers)  # raises InvalidMessage here, not on the I/O side
        if base.user_id is not None:
            self._check_user(base.user_id)
        if key is not None:
            bases = self._bases
            if len(bases) >= _CACHE_MAX:
                bases.clear()
            bases[key] = base
        return base

    def _check_header_size(self, base: MessageProperties, message_id: str) -> None:
        assert self._limits is not None
        frame_max = self._limits.frame_max
        table = encode_table(base.headers or {})
        if len(table) + _OTHER_PROPERTIES_MAX > frame_max:
            extra = _ENGINE_HEADERS_MAX
            if self._dedup_header is not None:
                extra += len(self._dedup_header) + len(message_id) + 8
            size = header_frame_size(base, message_id, extra)
            if size > frame_max:
                raise InvalidMessage("headers", header_too_large(size, frame_max))

    def _check_expiration(self, expiration: str) -> None:
        assert self._limits is not None
        broker = self._limits.broker
        if broker.expiration_max < EXPIRATION_MAX:  # a broker with a lower limit (LavinMQ)
            broker.check_expiration(expiration)

    def _check_user(self, user_id: str) -> None:
        users = self._users
        if users is not None and user_id not in users:
            raise InvalidMessage(
                "user_id",
                f"{user_id!r} is not the user this publisher connects as "
                f"({', '.join(sorted(map(repr, users)))}); the broker would close the channel",
            )


def _utf8_length(message_id: str) -> int:
    return len(message_id.encode("utf-8"))


#: checks :func:`build_message` (messages on their own, for no publisher)
_PLAIN: MessageBuilder[OutgoingMessage] = MessageBuilder(partial(new_outgoing, checked=True))
