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

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from sortedcontainers import SortedDict

from reliable_amqp._core.entry import Entry
from reliable_amqp._core.frames import headers_match

E = TypeVar("E", bound="Entry[Any]")


_SEQ_BITS = 40  # 1e12 publishes per channel before a generation would overflow into the next
_SEQ_MASK = (1 << _SEQ_BITS) - 1

#: Header stamped on a mandatory publish that goes out alone (after a frame error, or with a
#: dedup header, when the message gets headers of its own anyway) or carries a ``BCC`` header
#: (:func:`returns_altered`), naming its publish attempt for the ``basic.return`` (which has no
#: delivery tag). Every other mandatory publish goes out as the caller made it: its return is
#: matched by what it carries (ConfirmTracker.on_return).
ATTEMPT_HEADER = "x-reliable-amqp-attempt"


def returns_altered(headers: Mapping[str, Any]) -> bool:
    """Whether the broker hands back a message with these headers altered in a ``basic.return``.

    RabbitMQ removes ``BCC`` (it routes, then no one may see it), so two messages alike but for
    their ``BCC`` come back alike, although one may be routed and the other not: such a
    mandatory message goes out with :data:`ATTEMPT_HEADER`, and a return without one is never
    matched to it.
    """
    return "BCC" in headers


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


#: publishes per run of the tracker's sorted map: runs keep the map's work per publish small
RUN_MAX = 256


class _Run(Generic[E]):
    """Publishes with consecutive delivery tags; ``None`` where one was settled alone."""

    __slots__ = ("entries", "live")

    def __init__(self, entries: list[E | None], live: int) -> None:
        self.entries = entries
        self.live = live


class ConfirmTracker(Generic[E]):
    """Unconfirmed publish attempts of the current channel generation, in publish order.

    The sorted map (sortedcontainers) is keyed by the packed ``(generation, seq)`` of the first
    publish of a *run*: up to :data:`RUN_MAX` publishes with consecutive delivery tags. The
    broker numbers publishes 1, 2, 3, ... on a channel, so the publish with tag ``t`` is found by
    one bisection and an offset, and a multiple-ack takes whole runs off the front: the map
    changes once per run, not once per publish. A slot whose entry no longer carries its key
    (discarded, or sent again since) is empty; a run whose slots are all empty leaves the map.
    """

    def __init__(self) -> None:
        self._runs: SortedDict[int, _Run[E]] = SortedDict()
        self._open: _Run[E] | None = None  # the run new publishes are appended to
        self._generation = 0
        self._seq = 0
        self._live = 0
        #: key of the last entry a return without an attempt header matched: the broker returns
        #: in publish order, so the next one is searched for after it
        self._returned_at = 0

    @property
    def generation(self) -> int:
        """The current channel generation (bumped by :meth:`new_generation`)."""
        return self._generation

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[E]:
        return self._wire(0)

    def _wire(self, low: int, high: int | None = None) -> Iterator[E]:
        """The entries on the wire whose keys are from ``low`` to ``high`` (None: no limit), in
        publish order."""
        runs = self._runs
        keys = runs.keys()
        for first in keys[max(0, runs.bisect_right(low) - 1) :]:
            if high is not None and first > high:
                return
            for key, entry in enumerate(runs[first].entries, first):
                if (
                    entry is not None
                    and entry.key == key
                    and key >= low
                    and (high is None or key <= high)
                ):
                    yield entry

    def track(self, entry: E) -> int:
        """Record that ``entry`` is being published now; return its delivery tag (seq)."""
        self.track_all((entry,))
        return self._seq

    def track_all(self, entries: Sequence[E]) -> None:
        """:meth:`track` each of ``entries``, in order: the order they go on the wire."""
        seq = self._seq
        high = self._generation << _SEQ_BITS
        run = self._open
        count = len(entries)
        start = 0
        while start < count:  # whole slices into the open run, then into new ones
            if run is None or len(run.entries) >= RUN_MAX:
                run = self._open = _Run([], 0)
                self._runs[high | (seq + start + 1)] = run
            chunk = entries[start : start + RUN_MAX - len(run.entries)]
            run.entries.extend(chunk)
            run.live += len(chunk)
            start += len(chunk)
        for entry in entries:
            seq += 1
            entry.key = high | seq
            entry.returned = None
            entry.attempts += 1
        self._seq = seq
        self._live += count

    def _slot(self, key: int) -> tuple[int, _Run[E], int] | None:
        """(first key, run, offset) of the live entry tracked under ``key``, or None."""
        runs = self._runs
        at = runs.bisect_right(key) - 1
        if at < 0:
            return None
        first = runs.keys()[at]
        run = runs[first]
        offset = key - first
        if offset >= len(run.entries):
            return None
        entry = run.entries[offset]
        if entry is None or entry.key != key:
            return None
        return first, run, offset

    def _empty_slot(self, first: int, run: _Run[E], offset: int) -> E:
        """Empty one live slot; the run leaves the map once all its slots are empty."""
        entry = run.entries[offset]
        assert entry is not None
        run.entries[offset] = None
        entry.key = -1
        run.live -= 1
        self._live -= 1
        if not run.live and run is not self._open:
            del self._runs[first]
        return entry

    def on_return(
        self,
        attempt: object,
        reply_code: int,
        reply_text: str,
        *,
        returned: tuple[object, str, str, bytes, object] | None = None,
        generation: int | None = None,
    ) -> E | None:
        """Note a ``basic.return``; the ack that follows it settles the entry as returned.

        ``attempt`` is the :data:`ATTEMPT_HEADER` value of the returned message, None when it
        has none: then ``returned`` (its message_id, exchange, routing key, body and headers)
        names it, as the first mandatory entry on the wire that carries all five, searched from
        the last one matched (returns come in publish order: constant work per publish). The
        headers count because they route too (``CC``/``BCC``, headers exchanges): two messages
        alike but for a ``CC`` header can be one routed and one returned. Headers are compared
        as the client library decodes them (:func:`~reliable_amqp._core.frames.headers_match`:
        pika truncates a double, pamqp reads a late stamp as milliseconds); when no
        entry's headers agree, the first that carries the other four is taken. Two entries that
        match alike are the same message to the broker and to any consumer: whichever is taken,
        one copy was routed and one was not. ``generation`` is the channel's the return came on
        (None: the current one). A message with a ``BCC`` header went out with the attempt header
        (:func:`returns_altered`), so a return without one never names it. Returns the entry, or
        None when nothing on the wire matches (a stale generation, a message not ours).
        """
        if generation is not None and generation != self._generation:
            return None
        entry: E | None
        if attempt is None:
            entry = self._find_returned(returned) if returned is not None else None
            if entry is None:
                return None
        else:
            key = parse_attempt_tag(attempt)
            slot = self._slot(key) if key is not None else None
            if slot is None:
                return None
            _, run, offset = slot
            entry = run.entries[offset]
            assert entry is not None
        entry.returned = (reply_code, reply_text)
        return entry

    def _find_returned(self, returned: tuple[object, str, str, bytes, object]) -> E | None:
        message_id, exchange, routing_key, body, headers = returned
        after = self._returned_at
        loose: E | None = None  # the first that carries the other four
        # after the last match first (the broker's order), then from the start up to it
        for entry in itertools.chain(self._wire(after + 1), self._wire(0, after)):
            sent = entry.base.headers
            if (
                entry.message_id == message_id
                and entry.returned is None
                and entry.mandatory
                and entry.exchange == exchange
                and entry.routing_key == routing_key
                and entry.body == body
                and (sent is None or not returns_altered(sent))  # else it went tagged
            ):
                if headers_match(sent, headers):
                    loose = entry
                    break
                if loose is None:
                    loose = entry
        if loose is not None:
            self._returned_at = loose.key
        return loose

    def untrack(self, entry: E) -> bool:
        """Take back the latest :meth:`track` (its publish never reached the wire).

        Only the last tracked entry can be taken back, since the broker numbers publishes in
        order; returns False (and changes nothing) for any other entry.
        """
        if entry.key < 0 or entry.key != pack_key(self._generation, self._seq):
            return False
        slot = self._slot(entry.key)
        if slot is None:
            return False
        first, run, offset = slot
        if offset != len(run.entries) - 1:
            return False
        run.entries.pop()
        run.live -= 1
        if not run.entries:
            del self._runs[first]
            if run is self._open:
                self._open = None
        entry.key = -1
        entry.attempts -= 1
        self._seq -= 1
        self._live -= 1
        return True

    def discard(self, entry: E) -> bool:
        """Forget ``entry`` (its deadline passed); a later ack for it is ignored."""
        slot = self._slot(entry.key) if entry.key >= 0 else None
        if slot is None or slot[1].entries[slot[2]] is not entry:
            return False
        self._empty_slot(*slot)
        return True

    def new_generation(self) -> list[E]:
        """Start a new channel generation; hand back every unconfirmed entry in publish order.

        Called when the channel the entries went out on is gone: their confirms will never come,
        so the caller republishes them (on the new generation) or fails them.
        """
        unconfirmed = list(self)
        for entry in unconfirmed:
            entry.key = -1
        self._runs.clear()
        self._open = None
        self._live = 0
        self._returned_at = 0
        self._generation += 1
        self._seq = 0
        return unconfirmed

    def pop_settled(self, generation: int, tag: int, multiple: bool) -> list[E]:
        """The entries an ack or nack of ``tag`` (with ``multiple``) settles, in publish order,
        taken out of the tracker (an acked entry with ``returned`` set was returned)."""
        if generation != self._generation or tag <= 0:
            return []
        key = pack_key(generation, tag)
        if not multiple:
            slot = self._slot(key)
            return [] if slot is None else [self._empty_slot(*slot)]
        # Everything up to and including ``tag``: whole runs off the front of the map, then the
        # head of the run that holds ``tag`` (its rest goes back under the key of its new head).
        runs = self._runs
        settled: list[E] = []
        while runs:
            first, run = runs.peekitem(0)
            if first > key:
                break
            entries = run.entries
            end = key - first + 1
            del runs[first]
            whole = end >= len(entries)
            if whole:
                taken = entries
                if run is self._open:
                    self._open = None
            else:
                taken = entries[:end]
                del entries[:end]
            count = 0
            for k, entry in enumerate(taken, first):
                if entry is not None and entry.key == k:
                    entry.key = -1
                    settled.append(entry)
                    count += 1
            run.live -= count
            if not whole:
                if run.live or run is self._open:
                    runs[first + end] = run
                break
        self._live -= len(settled)
        return settled
