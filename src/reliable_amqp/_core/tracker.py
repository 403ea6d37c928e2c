"""ConfirmTracker: the messages on the wire, keyed by (channel generation, delivery tag).

Delivery tags restart at 1 on every channel, so a tag alone means nothing after a reconnect; the
tracker keys entries by ``(generation, seq)`` (packed into one int so the sorted map compares ints,
not tuples) and drops frames from a generation that is no longer current.

The tracker never calls anything: each method hands back what it settled and the caller decides
what that means (retry, fail, resolve). An entry leaves the tracker exactly once, which is what
makes "every handle resolves exactly once" hold even when LavinMQ acks a range with ``multiple``
that covers tags it had nacked one by one just before.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from sortedcontainers import SortedDict

from reliable_amqp._core.errors import PublishError
from reliable_amqp._core.message import Confirmation, OutgoingMessage

H = TypeVar("H")

_SEQ_BITS = 40  # 1e12 publishes per channel before a generation would overflow into the next
_SEQ_MASK = (1 << _SEQ_BITS) - 1

#: Header stamped on mandatory publishes so a ``basic.return`` (which has no delivery tag) can be
#: matched to its publish attempt. The user's ``message_id`` cannot serve: users repeat ids.
ATTEMPT_HEADER = "x-reliable-amqp-attempt"


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


class Outcome(enum.Enum):
    """How the broker settled one publish attempt."""

    ACKED = "acked"
    NACKED = "nacked"
    RETURNED = "returned"


@dataclass(slots=True, eq=False)
class Entry(Generic[H]):
    """One accepted message and its bookkeeping; ``handle`` is the adapter's (a future)."""

    message: OutgoingMessage
    handle: H
    deadline: float
    size: int
    attempts: int = 0
    #: packed (generation, seq) of the current attempt while on the wire, else -1
    key: int = -1
    returned: tuple[int, str] | None = None
    #: in flight when the broker closed the channel or connection and named no culprit: sent
    #: alone from then on, so the next such close names it
    isolated: bool = False
    #: how many nacks this message has had (the nack retry policy counts these)
    nacks: int = 0
    #: when the message was accepted (the clock the adapter passes in)
    accepted: float = 0.0
    #: where the message is (see PublishEngine)
    state: Stage = Stage.WAITING
    #: the outcome, once resolved: a Confirmation or the PublishError
    result: Confirmation | PublishError | None = None
    #: its issue number in the publisher's window (flush() counts by it)
    index: int = 0

    # An entry the engine resolved is its own resolution (no object is made for it):
    @property
    def entry(self) -> Entry[H]:
        """The entry itself (a resolved entry serves as its :class:`Resolution`)."""
        return self

    @property
    def ok(self) -> bool:
        """True when the message was confirmed."""
        return isinstance(self.result, Confirmation)


@dataclass(slots=True)  # not frozen: one is made per confirmed message, and frozen costs 2.5x
class Settled(Generic[H]):
    """An entry the broker settled, and how."""

    entry: Entry[H]
    outcome: Outcome


def pack_key(generation: int, seq: int) -> int:
    """The tracker's int key for (generation, seq)."""
    return (generation << _SEQ_BITS) | seq


def unpack_key(key: int) -> tuple[int, int]:
    """(generation, seq) from a packed key."""
    return key >> _SEQ_BITS, key & _SEQ_MASK


def attempt_tag(key: int) -> str:
    """The value of :data:`ATTEMPT_HEADER` for the attempt with this key."""
    generation, seq = unpack_key(key)
    return f"{generation}.{seq}"


def parse_attempt_tag(value: object) -> int | None:
    """The key an :data:`ATTEMPT_HEADER` value names, or None if it is not one of ours."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        return None
    generation, _, seq = value.partition(".")
    # ASCII digits only (str.isdigit() also accepts superscripts, which int() refuses), and
    # short enough for int() (it refuses 4300+ digits) and for the seq's bits in the key
    if not (generation.isascii() and generation.isdigit() and seq.isascii() and seq.isdigit()):
        return None
    if len(generation) > 20 or len(seq) > 13 or int(seq) > _SEQ_MASK:
        return None
    return pack_key(int(generation), int(seq))


class ConfirmTracker(Generic[H]):
    """Unconfirmed publish attempts of the current channel generation, in publish order."""

    def __init__(self) -> None:
        self._entries: SortedDict[int, Entry[H]] = SortedDict()
        self._generation = 0
        self._seq = 0

    @property
    def generation(self) -> int:
        """The current channel generation (bumped by :meth:`new_generation`)."""
        return self._generation

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry[H]]:
        return iter(self._entries.values())

    def track(self, entry: Entry[H]) -> int:
        """Record that ``entry`` is being published now; return its delivery tag (seq)."""
        self._seq += 1
        key = pack_key(self._generation, self._seq)
        entry.key = key
        entry.returned = None
        entry.attempts += 1
        self._entries[key] = entry
        return self._seq

    def on_ack(self, generation: int, tag: int, multiple: bool) -> list[Settled[H]]:
        """Settle a ``basic.ack``; a returned entry settles as RETURNED, the rest as ACKED."""
        return self._settle(generation, tag, multiple, Outcome.ACKED)

    def on_nack(self, generation: int, tag: int, multiple: bool) -> list[Settled[H]]:
        """Settle a ``basic.nack``."""
        return self._settle(generation, tag, multiple, Outcome.NACKED)

    def on_return(self, attempt: object, reply_code: int, reply_text: str) -> Entry[H] | None:
        """Note a ``basic.return``; the ack that follows it settles the entry as RETURNED.

        ``attempt`` is the :data:`ATTEMPT_HEADER` value of the returned message. Returns the
        entry, or None when the value matches no entry on the wire (a stale generation).
        """
        key = parse_attempt_tag(attempt)
        entry = self._entries.get(key) if key is not None else None
        if entry is not None:
            entry.returned = (reply_code, reply_text)
        return entry

    def untrack(self, entry: Entry[H]) -> bool:
        """Take back the latest :meth:`track` (its publish never reached the wire).

        Only the last tracked entry can be taken back, since the broker numbers publishes in
        order; returns False (and changes nothing) for any other entry.
        """
        if entry.key < 0 or entry.key != pack_key(self._generation, self._seq):
            return False
        del self._entries[entry.key]
        entry.key = -1
        entry.attempts -= 1
        self._seq -= 1
        return True

    def discard(self, entry: Entry[H]) -> bool:
        """Forget ``entry`` (its deadline passed); a later ack for it is ignored."""
        if entry.key >= 0 and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            entry.key = -1
            return True
        return False

    def new_generation(self) -> list[Entry[H]]:
        """Start a new channel generation; hand back every unconfirmed entry in publish order.

        Called when the channel the entries went out on is gone: their confirms will never come,
        so the caller republishes them (on the new generation) or fails them.
        """
        unconfirmed = list(self._entries.values())
        for entry in unconfirmed:
            entry.key = -1
        self._entries.clear()
        self._generation += 1
        self._seq = 0
        return unconfirmed

    def _settle(
        self, generation: int, tag: int, multiple: bool, outcome: Outcome
    ) -> list[Settled[H]]:
        settled = self._settled
        return [settled(entry, outcome) for entry in self.settle(generation, tag, multiple)]

    def settle(self, generation: int, tag: int, multiple: bool) -> list[Entry[H]]:
        """The entries an ack or nack of ``tag`` (with ``multiple``) settles, in publish order,
        taken out of the tracker (the bulk form of :meth:`on_ack`/:meth:`on_nack`: no object
        per entry; an acked entry with ``returned`` set was returned)."""
        if generation != self._generation or tag <= 0:
            return []
        key = pack_key(generation, tag)
        entries = self._entries
        if not multiple:
            entry = entries.pop(key, None)
            if entry is None:
                return []
            entry.key = -1
            return [entry]
        # Everything up to and including ``tag``. Only the current generation is ever tracked
        # (new_generation() empties the map), so that is a prefix, taken and deleted as one slice:
        # O(log n + k) (sortedcontainers rebuilds instead when k is over n/8).
        stop = entries.bisect_right(key)
        if not stop:
            return []
        acked = entries.values()[:stop]
        del entries.keys()[:stop]
        for entry in acked:
            entry.key = -1
        return acked

    @staticmethod
    def _settled(entry: Entry[H], outcome: Outcome) -> Settled[H]:
        if outcome is Outcome.ACKED and entry.returned is not None:
            outcome = Outcome.RETURNED
        return Settled(entry, outcome)
