"""Entry: one accepted message in flight, its stages, and the one factory that makes it.

An entry is what both publishers hand the core for each message and what the core hands back
once it is resolved: the same object from ``publish()`` to the resolved future (the sync
publisher's future *is* its entry). It holds the message's parts (what the encoders read, as
an :class:`OutgoingMessage` has them) and the engine's bookkeeping; it is built only by
:func:`fresh_entry` (or :data:`new_entry`, the same for a plain :class:`Entry`), production and
tests alike.

Its outcome, once resolved, is :attr:`Entry.outcome`: a :class:`Confirmation` or the
:class:`PublishError`. A confirm stores :data:`CONFIRMED` instead (:attr:`Entry.raw_outcome`),
so that it makes no object per message; the :class:`Confirmation` is built when something reads
:attr:`Entry.outcome`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Generic, TypeVar

from reliable_amqp._core.errors import PublishError
from reliable_amqp._core.message import (
    Confirmation,
    MessageParts,
    MessageProperties,
    OutgoingMessage,
    as_message,
    new_confirmation,
    with_headers,
)

H = TypeVar("H")
E = TypeVar("E", bound="Entry[Any]")


class Confirmed:
    """The raw outcome of a confirmed entry (:data:`CONFIRMED`): its :class:`Confirmation` is
    built from the entry when something asks for it (``Entry.outcome``, ``future.result()``).
    A confirm then makes no object per message, and most futures are never asked."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CONFIRMED"


CONFIRMED = Confirmed()


class Stage(enum.Enum):
    """Where an accepted message is; the engine moves it (compared with ``is``: cheap)."""

    #: queued to be written (first time, after a channel loss, or after a nack's backoff)
    WAITING = "waiting"
    #: written; its confirm is awaited
    WIRE = "wire"
    #: nacked; waiting for its retry time
    BACKOFF = "backoff"
    #: resolved: confirmed or failed, exactly once
    DONE = "done"


class Entry(MessageParts, Generic[H]):
    """One accepted message in flight and its bookkeeping; ``handle`` is the adapter's (the
    async publisher's future; the sync publisher's entries are their own futures).

    Not a message to the user: it holds a message's parts and :attr:`message` builds the plain
    :class:`OutgoingMessage` errors carry, once, when something asks. A message in flight is one
    object for the garbage collector: ``publish()`` builds it (:func:`fresh_entry`, the only
    way: there is no ``__init__``) and the engine takes it (:meth:`PublishEngine.accept` sets
    the rest). Every field is a slot: an instance dict would be a second object. Entries
    compare by identity.
    """

    __slots__ = (
        "_message",
        "accepted",
        "attempts",
        "base",
        "body",
        "deadline",
        "exchange",
        "handle",
        "index",
        "isolated",
        "key",
        "mandatory",
        "message_id",
        "nacks",
        "raw_outcome",
        "returned",
        "routing_key",
        "size",
        "state",
    )

    # the message's parts (MessageParts); base is shared between messages: replaced, never
    # changed
    exchange: str
    routing_key: str
    body: bytes
    base: MessageProperties
    mandatory: bool
    message_id: str
    handle: H
    deadline: float
    size: int
    attempts: int
    #: packed (generation, seq) of the current attempt while on the wire, else -1
    key: int
    returned: tuple[int, str] | None
    #: in flight when the broker closed the channel or connection and named no culprit: sent
    #: alone from then on, so the next such close names it
    isolated: bool
    #: how many nacks this message has had (the nack retry policy counts these)
    nacks: int
    #: when the message was accepted (the clock the adapter passes in)
    accepted: float
    #: where the message is (see PublishEngine)
    state: Stage
    #: the outcome as the engine stored it: :data:`CONFIRMED` for a :class:`Confirmation` not
    #: built yet, else what :attr:`outcome` gives (the fast paths that settle futures read this)
    raw_outcome: Confirmed | Confirmation | PublishError | None
    #: its issue number in the publisher's window (flush() counts by it)
    index: int
    _message: OutgoingMessage | None

    @property
    def message(self) -> OutgoingMessage:
        """The message as an :class:`OutgoingMessage` (what errors carry), built once."""
        message = self._message
        if message is None:
            message = self._message = as_message(self)
        return message

    def add_headers(self, extra: Mapping[str, Any]) -> None:
        """Add ``extra`` to the message's headers (they win over its own): its properties,
        often shared with other messages, are replaced, never changed."""
        base = self.base
        self.base = with_headers(base, {**base.headers, **extra} if base.headers else {**extra})
        self._message = None

    @property
    def outcome(self) -> Confirmation | PublishError | None:
        """What became of the message, once resolved: a :class:`Confirmation` or the
        :class:`PublishError` (None while unresolved)."""
        outcome = self.raw_outcome
        if isinstance(outcome, Confirmed):
            confirmation = new_confirmation(self.message_id, self.attempts)
            self.raw_outcome = confirmation
            return confirmation
        return outcome

    @outcome.setter
    def outcome(self, value: Confirmation | PublishError | None) -> None:
        self.raw_outcome = value

    @property
    def ok(self) -> bool:
        """True when the message was confirmed."""
        outcome = self.raw_outcome
        return outcome is CONFIRMED or isinstance(outcome, Confirmation)

    def __repr__(self) -> str:
        return (
            f"<Entry {self.message_id!r} to {self.exchange!r}/{self.routing_key!r} "
            f"{self.state.value}, {self.attempts} attempts>"
        )


_new = object.__new__


_WAITING = Stage.WAITING


def fresh_entry(  # noqa: PLR0917
    cls: type[E],
    exchange: str,
    routing_key: str,
    body: bytes,
    base: MessageProperties,
    mandatory: bool,
    message_id: str,
) -> E:
    """The one factory of entries: a message to publish, from checked parts (``base`` has no
    message_id), as an entry of ``cls`` (``Entry``, or a subclass: the sync publisher's
    future, whose own fields the caller sets), ready for the engine to take."""
    # Plain attribute stores on slots: the interpreter's cheapest store
    entry: E = _new(cls)
    entry.exchange = exchange
    entry.routing_key = routing_key
    entry.body = body
    entry.base = base
    entry.mandatory = mandatory
    entry.message_id = message_id
    entry._message = None
    entry.handle = None
    # a fresh entry's bookkeeping; accepting sets the rest (deadline, accepted)
    entry.size = len(body)
    entry.index = 0
    entry.attempts = 0
    entry.key = -1
    entry.returned = None
    entry.isolated = False
    entry.nacks = 0
    entry.state = _WAITING
    entry.raw_outcome = None
    return entry


#: :func:`fresh_entry` for a plain :class:`Entry` (the async publisher's, and the core's tests')
new_entry: Callable[[str, str, bytes, MessageProperties, bool, str], Entry[Any]] = partial(
    fresh_entry, Entry
)
