"""Messages as the library holds them: :class:`OutgoingMessage`, its properties, the
:class:`Confirmation` of one, and message ids.

Values only: the checks that turn what a caller gives ``publish()`` into one of these are in
:mod:`reliable_amqp._core.builder`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

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
        "_checked",
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
    #: made by ``build_message`` (see :func:`checked`)
    _checked: bool

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


class MessageParts(Protocol):
    """What a message is made of, as what encodes it reads it (its frames, its spool record):
    an :class:`OutgoingMessage`, or a publisher's in-flight entry for one."""

    __slots__ = ()  # an entry that subclasses it keeps slots only

    exchange: str
    routing_key: str
    body: bytes
    #: its properties without ``message_id``
    base: MessageProperties
    mandatory: bool
    message_id: str


def as_message(parts: MessageParts) -> OutgoingMessage:
    """``parts`` as an :class:`OutgoingMessage` (itself when it is one): what errors carry."""
    if isinstance(parts, OutgoingMessage):
        return parts
    return new_outgoing(
        parts.exchange, parts.routing_key, parts.body, parts.base, parts.mandatory, parts.message_id
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
# largest single cost of publish() (docs/benchmarks.md, "Why the hot path reads as it does").
# Same classes, same objects: still frozen, equal to what the constructors build (tests/core).
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
_set_checked = _slot_setter(OutgoingMessage, "_checked")


def _init_message(  # noqa: PLR0917
    message: OutgoingMessage,
    exchange: str,
    routing_key: str,
    body: bytes,
    base: MessageProperties,
    mandatory: bool,
    message_id: str,
) -> None:
    """Set a message's fields through their slots (no ``properties`` built yet, not marked
    checked): what ``OutgoingMessage.__init__`` and :func:`new_outgoing` share."""
    _set_exchange(message, exchange)
    _set_routing_key(message, routing_key)
    _set_body(message, body)
    _set_base(message, base)
    _set_mandatory(message, mandatory)
    _set_message_id(message, message_id)
    _set_cached_properties(message, None)
    _set_checked(message, False)


def new_outgoing(  # noqa: PLR0917
    exchange: str,
    routing_key: str,
    body: bytes,
    base: MessageProperties,
    mandatory: bool,
    message_id: str,
    *,
    checked: bool = False,
) -> OutgoingMessage:
    """An :class:`OutgoingMessage` from checked parts, built fast (``base`` has no id);
    ``checked``: made by the message checker (``build_message``), which a publisher then takes
    without checking it again (see :func:`checked`)."""
    message: OutgoingMessage = _new(OutgoingMessage)
    _init_message(message, exchange, routing_key, body, base, mandatory, message_id)
    if checked:
        _set_checked(message, True)
    return message


def checked(message: OutgoingMessage) -> bool:
    """Whether ``message`` was made by ``build_message`` (its fields all checked): not one
    built by hand, by :meth:`OutgoingMessage.replace` or unpickled."""
    return message._checked


_set_confirmed_id = _slot_setter(Confirmation, "message_id")
_set_attempts = _slot_setter(Confirmation, "attempts")


def new_confirmation(message_id: str, attempts: int) -> Confirmation:
    """``Confirmation(message_id, attempts)``, built fast (one per confirmed message)."""
    confirmation: Confirmation = _new(Confirmation)
    _set_confirmed_id(confirmation, message_id)
    _set_attempts(confirmation, attempts)
    return confirmation


# ``dataclasses.replace`` on the frozen properties sets each field through object.__setattr__;
# copying the slots through their descriptors costs a fifth of it (docs/benchmarks.md).
_PROPERTY_SLOTS = [
    (vars(MessageProperties)[f.name].__get__, vars(MessageProperties)[f.name].__set__)
    for f in dataclasses.fields(MessageProperties)
    if f.name != "headers"
]
_set_headers: Callable[[object, Any], None] = vars(MessageProperties)["headers"].__set__


def with_headers(base: MessageProperties, headers: dict[str, Any]) -> MessageProperties:
    """``dataclasses.replace(base, headers=headers)``, built fast (the same frozen object)."""
    props: MessageProperties = object.__new__(MessageProperties)
    for get, set_ in _PROPERTY_SLOTS:
        set_(props, get(base))
    _set_headers(props, headers)
    return props
