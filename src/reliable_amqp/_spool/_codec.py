"""How a message is stored in the spool: everything but the body, as one tagged binary record.

The record has to give back an *equal* :class:`~reliable_amqp.OutgoingMessage` years later, in
another process and another version of this library, so it is a format of its own rather than
the AMQP wire encoding (which loses types: a naive ``datetime`` and an aware one, a ``tuple`` and
a ``list``, microseconds, ``Decimal('1.50')`` against ``Decimal('1.5')``) or ``pickle`` (which
ties the file to class paths and runs code when a tampered file is read).

Layout (format 1)::

    u8 format | u8 flags (bit 0: mandatory) | u16 present properties (AMQP order, bit 15 first)
    str exchange | str routing_key | u32 size of: one value per present property but
    message_id, in AMQP order | message_id (when present)

Values are tagged: ``N`` None, ``t``/``f`` bool, ``i`` int64, ``J`` a larger int as text,
``d`` double, ``s`` str (UTF-8, lone surrogates kept), ``b`` bytes, ``D`` Decimal as text,
``T`` datetime in ISO 8601 (its UTC offset), ``Z`` datetime in a ``zoneinfo`` zone (wall time,
zone key, fold), ``M`` mapping, ``L`` list,
``U`` tuple. Lengths and counts are u32, big-endian.
"""

from __future__ import annotations

import datetime as _dt
import struct
import zoneinfo
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from reliable_amqp._core.message import (
    DEFAULT_BASE,
    PERSISTENT,
    PROPERTY_ORDER,
    MessageParts,
    MessageProperties,
    new_outgoing,
)

FORMAT = 1

#: presence-mask bit of each property, in AMQP order (bit 15 first)
_BITS = tuple(1 << (15 - i) for i in range(len(PROPERTY_ORDER)))
_DELIVERY_MODE_BIT = _BITS[PROPERTY_ORDER.index("delivery_mode")]
_MESSAGE_ID_BIT = _BITS[PROPERTY_ORDER.index("message_id")]
#: (bit, name) of the properties stored apart from the id (shared between messages)
_BASE_PROPERTIES = tuple(
    (bit, name) for bit, name in zip(_BITS, PROPERTY_ORDER, strict=True) if name != "message_id"
)

_head = struct.Struct(">BBH")
_u8 = struct.Struct(">B")
_u32 = struct.Struct(">I")
_u32_at = _u32.unpack_from
_i64 = struct.Struct(">q")
_f64 = struct.Struct(">d")
_INT64 = (-(2**63), 2**63 - 1)
_DEPTH_MAX = 64


class CodecError(ValueError):
    """A stored record cannot be decoded (the spool names the file and the entry)."""


class Unstorable(ValueError):
    """A message holds a value the spool cannot store (``path`` names it)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


def _text(value: str) -> bytes:
    data = value.encode("utf-8", "surrogatepass")
    return _u32.pack(len(data)) + data


# Records are built from parts that repeat: the route (exchange, routing key, mandatory) and the
# properties but the id, which messages published with the same properties share (a message
# holds them as ``base``). Both are encoded once and kept in small bounded caches.
_routes: dict[tuple[str, str, bool], bytes] = {}
_bases: dict[int, tuple[MessageProperties, int, bytes]] = {}
#: (exchange, routing_key, mandatory, id(base)) -> (base, record up to the message id's length)
_prefixes: dict[tuple[str, str, bool, int], tuple[MessageProperties, bytes]] = {}
_CACHE_MAX = 1024
#: (base, exchange, routing_key, mandatory, prefix) of the last message encoded by its prefix
_last: list[Any] = [object(), None, None, None, b""]
#: the packed length of an id shorter than _SHORT bytes
_SHORT = 256
_LENGTHS = [_u32.pack(n) for n in range(_SHORT)]


def _route(exchange: str, routing_key: str, mandatory: bool) -> bytes:
    key = (exchange, routing_key, mandatory)
    route = _routes.get(key)
    if route is None:
        route = _text(_check_str("exchange", exchange)) + _text(
            _check_str("routing_key", routing_key)
        )
        if len(_routes) >= _CACHE_MAX:
            _routes.clear()
        _routes[key] = route
    return route


def _properties(props: MessageProperties) -> tuple[int, bytes]:
    """The presence mask and values of every property but ``message_id``."""
    mask = 0
    parts: list[bytes] = []
    for bit, name in _BASE_PROPERTIES:
        value = getattr(props, name)
        if value is not None:
            mask |= bit
            _value(parts, value, name, 0)
    return mask, b"".join(parts)


def _base(base: MessageProperties) -> tuple[int, bytes]:
    cached = _bases.get(id(base))
    if cached is not None and cached[0] is base:
        return cached[1], cached[2]
    mask, encoded = _properties(base)
    if len(_bases) >= _CACHE_MAX:
        _bases.clear()
    _bases[id(base)] = (base, mask, encoded)
    return mask, encoded


def encode(message: MessageParts) -> bytes:
    """The stored record of everything in ``message`` but its body.

    Raises :class:`Unstorable` for a value with no stored form (``build_message`` lets none
    through; a hand-made :class:`OutgoingMessage` might hold one).
    """
    given_id = message.message_id
    last = _last
    if (
        message.base is last[0]
        and message.exchange is last[1]
        and message.routing_key is last[2]
        and message.mandatory is last[3]
        and type(given_id) is str
        and given_id
    ):
        # the usual case at its quickest: the same route and properties objects as the last
        # message (a loop of publish() calls), an id of the usual length
        data = given_id.encode("utf-8", "surrogatepass")
        if len(data) < _SHORT:
            prefix: bytes = last[4]
            return prefix + _LENGTHS[len(data)] + data
    mandatory = message.mandatory
    base = message.base
    if type(given_id) is str and given_id:
        # the usual case: the record is a prefix shared by every message with this route and
        # these properties (the base object), and the id
        try:
            cached = _prefixes.get((message.exchange, message.routing_key, mandatory, id(base)))
        except TypeError:  # a hand-made message with an unhashable field: checked below
            cached = None
        if cached is not None and cached[0] is base:
            _last[:] = (base, message.exchange, message.routing_key, mandatory, cached[1])
            data = given_id.encode("utf-8", "surrogatepass")
            return cached[1] + _u32.pack(len(data)) + data
    if type(mandatory) is not bool:
        raise Unstorable("mandatory", f"must be a bool, not {type(mandatory).__name__}")
    mask, encoded = _base(base)  # properties held apart from the id ("" when there is none)
    message_id: object = message.message_id or None
    head = _route(message.exchange, message.routing_key, mandatory)
    encoded = _u32.pack(len(encoded)) + encoded
    if message_id is None:
        return _head.pack(FORMAT, mandatory, mask) + head + encoded
    if type(message_id) is not str:
        tail: list[bytes] = []
        _value(tail, message_id, "message_id", 0)
        return (
            _head.pack(FORMAT, mandatory, mask | _MESSAGE_ID_BIT) + head + encoded + b"".join(tail)
        )
    prefix = _head.pack(FORMAT, mandatory, mask | _MESSAGE_ID_BIT) + head + encoded + b"s"
    if base is not None:
        if len(_prefixes) >= _CACHE_MAX:
            _prefixes.clear()
        _prefixes[(message.exchange, message.routing_key, mandatory, id(base))] = (base, prefix)
    return prefix + _text(message_id)


def _check_str(name: str, value: object) -> str:
    if type(value) is not str:
        if isinstance(value, str):
            return str(value)
        raise Unstorable(name, f"must be a str, not {type(value).__name__}")
    return value


def _value(parts: list[bytes], value: Any, path: str, depth: int) -> None:
    if depth > _DEPTH_MAX:
        raise Unstorable(path, f"nested deeper than {_DEPTH_MAX} levels")
    # bool before int (a bool is an int); str and bytes before the generic containers
    if isinstance(value, str):
        parts.append(b"s")
        parts.append(_text(value))
    elif isinstance(value, bool):
        parts.append(b"t" if value else b"f")
    elif isinstance(value, int):
        if _INT64[0] <= value <= _INT64[1]:
            parts.append(b"i" + _i64.pack(value))
        else:
            parts.append(b"J" + _text(str(int(value))))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        parts.append(b"b" + _u32.pack(len(data)))
        parts.append(data)
    elif value is None:
        parts.append(b"N")
    elif isinstance(value, float):
        parts.append(b"d" + _f64.pack(value))
    elif isinstance(value, Decimal):
        parts.append(b"D" + _text(str(value)))
    elif isinstance(value, _dt.datetime):
        zone = value.tzinfo
        if isinstance(zone, zoneinfo.ZoneInfo) and zone.key:
            # the zone itself: a wall time in a DST gap or fold equals no fixed-offset time
            local = value.replace(tzinfo=None).isoformat()
            parts.append(
                b"Z" + _text(local) + _text(zone.key) + (b"\x01" if value.fold else b"\x00")
            )
        else:
            parts.append(b"T" + _text(value.isoformat()))
    elif isinstance(value, Mapping):
        parts.append(b"M" + _u32.pack(len(value)))
        for key, item in value.items():
            if not isinstance(key, str):
                raise Unstorable(f"{path}[{key!r}]", "mapping keys must be str")
            parts.append(_text(key))
            _value(parts, item, f"{path}[{key!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        parts.append((b"U" if isinstance(value, tuple) else b"L") + _u32.pack(len(value)))
        for i, item in enumerate(value):
            _value(parts, item, f"{path}[{i}]", depth + 1)
    else:
        raise Unstorable(path, f"a {type(value).__name__} has no stored form")


#: what :func:`decode` builds a message with, from checked parts (``new_outgoing``'s signature)
Build = Callable[[str, str, bytes, MessageProperties, bool, str], MessageParts]


def decode(meta: bytes, body: bytes, build: Build = new_outgoing) -> MessageParts:
    """The message a record (and its body) stands for; raises :class:`CodecError` if corrupt.

    ``build`` makes it from its parts (a publisher passes what makes its engine's entries, so
    that a message read back is one object, not a message copied into an entry); a message
    whose id is not a str (a hand-made message's) is built so too, and fails when encoded.
    """
    last = _last_decoded
    prefix: bytes = last[0]
    if prefix and meta.startswith(prefix):
        # the usual case at its quickest: the same route and properties as the record decoded
        # before (a backlog of one producer's messages): only the id is new
        at = len(prefix)
        if len(meta) >= at + 4 and _u32_at(meta, at)[0] == len(meta) - at - 4:
            try:
                same_id = meta[at + 4 :].decode("utf-8", "surrogatepass")
            except UnicodeDecodeError as exc:
                raise CodecError(f"malformed record (UnicodeDecodeError: {exc})") from None
            return build(last[1], last[2], bytes(body), last[3], last[4], same_id)
    try:
        version, flags, mask = _head.unpack_from(meta)
        if version != FORMAT:
            raise CodecError(f"unknown record format {version} (this version reads {FORMAT})")
        if flags & ~1:
            raise CodecError(f"unknown record flags {flags:#x}")
        if mask & ~_ALL_BITS:
            raise CodecError(f"unknown property bits {mask:#x}")
        # three length-prefixed fields, read inline (reading back a long outage is this loop)
        size = len(meta)
        at = 4 + 4 + _u32_at(meta, 4)[0]
        route_end = at + 4 + _u32_at(meta, at)[0]
        base_end = route_end + 4 + _u32_at(meta, route_end)[0]
        if base_end > size:
            raise CodecError("a length runs past the end of the record")
        # the same str objects for the same route: the frame encoder's fast path holds while
        # messages share route and properties, compared by identity
        raw_route = meta[8:route_end]
        route = _decoded_routes.get(raw_route)
        if route is None:
            route = (
                meta[8:at].decode("utf-8", "surrogatepass"),
                meta[at + 4 : route_end].decode("utf-8", "surrogatepass"),
            )
            if len(_decoded_routes) >= _CACHE_MAX:
                _decoded_routes.clear()
            _decoded_routes[raw_route] = route
        exchange, routing_key = route
        raw = meta[route_end + 4 : base_end]
        if mask & ~_MESSAGE_ID_BIT == _DELIVERY_MODE_BIT and raw == _PERSISTENT_ONLY:
            base = _DEFAULT_BASE  # the usual properties: persistent, nothing else
        else:
            key = (mask, raw)
            cached = _decoded_bases.get(key)
            if cached is None:
                cached = _decode_base(mask, raw)
                if len(_decoded_bases) >= _CACHE_MAX:
                    _decoded_bases.clear()
                _decoded_bases[key] = cached
            base = cached
        message_id: Any = None
        if mask & _MESSAGE_ID_BIT:
            if meta[base_end : base_end + 1] == b"s" and base_end + 5 <= size:
                id_end = base_end + 5 + _u32_at(meta, base_end + 1)[0]
                message_id = meta[base_end + 5 : id_end].decode("utf-8", "surrogatepass")
            else:
                reader = _Reader(meta)
                reader.at = base_end
                message_id = reader.value(0)
                id_end = reader.at
        else:
            id_end = base_end
        if id_end != size:
            raise CodecError(f"the record is {size} bytes, its fields {id_end}")
        mandatory = bool(flags & 1)
        if type(message_id) is str and meta[base_end : base_end + 1] == b"s" and message_id:
            # checked whole: the next record that starts the same way needs only its id read
            _last_decoded[:] = (meta[: base_end + 1], exchange, routing_key, base, mandatory)
        return build(exchange, routing_key, bytes(body), base, mandatory, message_id or "")
    except CodecError:
        raise
    except (struct.error, IndexError, UnicodeDecodeError, ValueError, InvalidOperation) as exc:
        raise CodecError(f"malformed record ({type(exc).__name__}: {exc})") from None


def _decode_base(mask: int, raw: bytes) -> MessageProperties:
    reader = _Reader(raw)
    values: dict[str, Any] = {}
    for bit, name in _BASE_PROPERTIES:
        if mask & bit:
            values[name] = reader.value(0)
    if reader.at != len(raw):
        raise CodecError(f"{len(raw) - reader.at} stray bytes after the properties")
    if "delivery_mode" not in values:
        raise CodecError("no delivery_mode")
    return MessageProperties(**values)


_ALL_BITS = sum(_BITS)
_PERSISTENT_ONLY = b"i" + _i64.pack(PERSISTENT)
_DEFAULT_BASE = DEFAULT_BASE  # the very object publish() uses (see decode's route cache)
_decoded_bases: dict[tuple[int, bytes], MessageProperties] = {}
_decoded_routes: dict[bytes, tuple[str, str]] = {}
#: (record up to the id's length, exchange, routing_key, base, mandatory) of the last record
#: decoded whole whose id is a str
_last_decoded: list[Any] = [b"", "", "", DEFAULT_BASE, False]


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        values = fmt.unpack_from(self.data, self.at)
        self.at += fmt.size
        return values

    def raw(self) -> bytes:
        (size,) = self.unpack(_u32)
        end = self.at + size
        if end > len(self.data):
            raise CodecError(f"a length of {size} runs past the end of the record")
        data = self.data[self.at : end]
        self.at = end
        return bytes(data)

    def text(self) -> str:
        return self.raw().decode("utf-8", "surrogatepass")

    def value(self, depth: int) -> Any:
        if depth > _DEPTH_MAX:
            raise CodecError(f"values nested deeper than {_DEPTH_MAX} levels")
        if self.at >= len(self.data):
            raise CodecError("the record ends inside a value")
        tag = self.data[self.at : self.at + 1]
        self.at += 1
        if tag == b"s":
            return self.text()
        if tag == b"i":
            return self.unpack(_i64)[0]
        if tag == b"N":
            return None
        if tag == b"t":
            return True
        if tag == b"f":
            return False
        if tag == b"b":
            return self.raw()
        if tag == b"d":
            return self.unpack(_f64)[0]
        if tag == b"J":
            return int(self.text())
        if tag == b"D":
            return Decimal(self.text())
        if tag == b"T":
            return _dt.datetime.fromisoformat(self.text())
        if tag == b"Z":
            local = _dt.datetime.fromisoformat(self.text())
            key = self.text()
            fold = self.unpack(_u8)[0]
            if fold > 1:
                raise CodecError(f"a fold of {fold}")
            try:
                zone = zoneinfo.ZoneInfo(key)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
                raise CodecError(f"time zone {key!r} is not known here: {exc}") from None
            return local.replace(tzinfo=zone, fold=fold)
        if tag == b"M":
            (count,) = self.unpack(_u32)
            table: dict[str, Any] = {}
            for _ in range(count):
                key = self.text()
                table[key] = self.value(depth + 1)
            return table
        if tag in (b"L", b"U"):
            (count,) = self.unpack(_u32)
            if count > len(self.data) - self.at:  # every value takes a byte at least
                raise CodecError(f"an array of {count} values runs past the end of the record")
            items = [self.value(depth + 1) for _ in range(count)]
            return tuple(items) if tag == b"U" else items
        raise CodecError(f"unknown value tag {tag!r} at byte {self.at - 1}")
