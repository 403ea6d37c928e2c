"""PublishEngine: the I/O-free heart of both publishers.

It owns every accepted message until the message is resolved, and decides what each broker frame
means for it: confirmed, retried after a nack (with backoff), failed, republished after a channel
loss, or expired. Adapters feed it frames and the clock, write what it says to write, and turn the
resolved entries it returns (each with its ``outcome``) into resolved futures: one place settles
every message.

Not thread-safe: an adapter calls it from one thread (the I/O thread, or the event loop).
"""

from __future__ import annotations

import heapq
import random
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from reliable_amqp._core.brokers import ANY_BROKER, BrokerLimitExceeded, BrokerLimits
from reliable_amqp._core.entry import CONFIRMED, Entry, Stage
from reliable_amqp._core.errors import (
    DeliveryTimeout,
    InvalidMessage,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    PublisherClosed,
    PublishError,
)
from reliable_amqp._core.frames import PublishEncoder, publish_frames
from reliable_amqp._core.message import Confirmation, new_confirmation
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.stats import Counters, Stats
from reliable_amqp._core.tracker import (
    ATTEMPT_HEADER,
    ConfirmTracker,
    attempt_tag,
    returns_altered,
)

E = TypeVar("E", bound="Entry[Any]")

# module globals: cheaper on the hot path than enum attribute lookups
WAITING, WIRE, BACKOFF, DONE = Stage.WAITING, Stage.WIRE, Stage.BACKOFF, Stage.DONE

# What the reply text of a close that blames a message says about which one it was
_EXCHANGE_IN_TEXT = re.compile(r"exchange '((?:[^']|'')*)'")
_SIZE_IN_TEXT = re.compile(r"message size (\d+)")

#: publishes written per batch: confirms are read between batches
BATCH_COUNT = 2000
#: body bytes per batch: a large body goes out in a write of its own
BATCH_BYTES = 1 << 20

#: what encoding a message's frames can raise (a gap in publish()'s checks)
ENCODE_ERRORS = (InvalidMessage, TypeError, ValueError, OverflowError)


def _unencodable(entry: Entry[Any], exc: Exception) -> MessageRejected:
    if isinstance(exc, BrokerLimitExceeded):  # taken before the broker was known
        return MessageRejected(entry.message, entry.attempts, 0, str(exc))
    return MessageRejected(entry.message, entry.attempts, 0, f"could not be encoded: {exc}")


class PublishEngine(Generic[E]):
    """Every accepted, unresolved message, and the rules that resolve it exactly once."""

    def __init__(
        self,
        *,
        delivery_timeout: float,
        nack_policy: RetryPolicy,
        dedup_header: str | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.tracker: ConfirmTracker[E] = ConfirmTracker()
        self.delivery_timeout = delivery_timeout
        self.nack_policy = nack_policy
        self.dedup_header = dedup_header
        self._rng = rng
        self._sendq: deque[E] = deque()
        # accept order == deadline order (one delivery_timeout for all); resolved entries are
        # dropped lazily from the left, and compacted when they pile up behind a slow one
        self._fifo: deque[E] = deque()
        self._retry: list[tuple[float, int, E]] = []
        self._retry_seq = 0
        self._live = 0
        # After a connection close for a frame or syntax error, the messages that were in flight
        # go out one at a time until each is settled: the next such close names the culprit.
        self._isolated = 0  # unresolved isolated entries
        self._probe: E | None = None  # the isolated entry on the wire, alone
        self.counters = Counters()
        #: told of each message that goes out again, with "retry" (nacked, after its backoff)
        #: or "republish" (its channel or connection was lost): telemetry's span events
        self.on_resend: Callable[[E, str], None] | None = None
        self._encoder: PublishEncoder | None = None  # for the channel and frame_max in use

    # --- accepting and sending --------------------------------------------------------------

    def __len__(self) -> int:
        """How many accepted messages are not resolved yet."""
        return self._live

    def accept(self, entries: Sequence[E], now: float) -> None:
        """Take messages, queued to be written in this order: fresh entries
        (:func:`~reliable_amqp._core.entry.fresh_entry`, or the sync publisher's futures), each
        with its ``index`` (its issue number in the window) and ``handle`` set by the adapter.
        """
        deadline = now + self.delivery_timeout
        count = len(entries)
        for entry in entries:
            entry.deadline = deadline
            entry.accepted = now
        # For a KeyboardInterrupt (taken where a C call returns, in the async publisher's
        # thread): the counts, then both queues, the send queue even when one is taken at the
        # first's return: the message is whole in the engine or not in it (:meth:`holds`).
        self._live += count
        self.counters.published += count
        try:
            self._fifo.extend(entries)
        finally:  # (taken at the extend's return, it still sends them)
            self._sendq.extend(entries)

    def holds(self, entry: E) -> bool:
        """Whether ``entry`` is the latest message :meth:`accept` took (an interrupted
        admission asks: see ``_core.admission``)."""
        fifo = self._fifo
        return bool(fifo) and fifo[-1] is entry

    def has_sendable(self) -> bool:
        """Whether :meth:`next_run` may have something (possibly an already-resolved entry)."""
        return bool(self._sendq)

    @property
    def isolating(self) -> bool:
        """True while suspects of a connection-level frame error are sent one at a time (the
        adapter writes again after each confirm)."""
        return self._isolated > 0

    @property
    def generation(self) -> int:
        """The channel generation the next publishes go out on (confirms of another are stale)."""
        return self.tracker.generation

    def next_run(self, max_count: int, max_bytes: int) -> tuple[list[E], bool]:
        """The next messages to write, in order, now on their way (``WIRE``).

        Returns ``(entries, True)``: a run to write as the messages were made, at most
        ``max_count``, ending with the one whose body reaches ``max_bytes`` in all (the first is
        taken whatever its size), then recorded by :meth:`sent`; or ``([entry], False)``: one
        to write with headers of its own, which :meth:`mark_sent` records and returns (a dedup
        header, or the attempt header of a mandatory message whose return the broker alters:
        :func:`~reliable_amqp._core.tracker.returns_altered`). Empty when nothing waits. One
        whose frames cannot be encoded goes to :meth:`fail` instead (after :meth:`unmark_sent`,
        once marked). While :attr:`isolating`, a suspect is taken alone, once nothing else is on
        the wire, and nothing is taken while it is on the wire.
        """
        sendq = self._sendq
        taken: list[E] = []
        isolating = self._isolated > 0
        if isolating:
            probe = self._probe
            if probe is not None and probe.state is WIRE:
                return taken, True  # a suspect is on the wire alone: wait for its outcome
            self._probe = None
        keep = taken.append
        own = self.dedup_header is not None
        size = 0
        while sendq and size < max_bytes:
            entry = sendq.popleft()
            if entry.state is not WAITING:
                continue  # resolved while queued (expired, closed)
            headers = entry.base.headers
            alone = own or (headers is not None and entry.mandatory and returns_altered(headers))
            if alone or (isolating and entry.isolated):
                suspect = isolating and entry.isolated
                if taken or (suspect and len(self.tracker)):
                    # next, in a run of its own (a suspect: once nothing else is on the wire)
                    sendq.appendleft(entry)
                    break
                if suspect:
                    self._probe = entry
                entry.state = WIRE
                return [entry], not alone
            entry.state = WIRE
            keep(entry)
            size += entry.size
            if len(taken) >= max_count:
                break
        return taken, True

    def sent(self, entries: Sequence[E]) -> None:
        """Record that ``entries`` (a run from :meth:`next_run`) were written as they were made, in
        this order: the next publishes on the channel, now awaiting their confirms."""
        self.tracker.track_all(entries)

    def unmark_sent(self, entry: E) -> None:
        """The entry :meth:`mark_sent` just recorded was not written after all (its frames
        failed to encode): its delivery tag goes to the next publish."""
        self.tracker.untrack(entry)

    def mark_sent(self, entry: E) -> Mapping[str, Any] | None:
        """Record that ``entry`` (from :meth:`next_run`) is being written now, alone (the next
        publish on the channel), and return the headers to write it with: the message's own,
        plus the attempt header on mandatory messages (to correlate a ``basic.return``) and the
        dedup header when configured; None when the message's headers go out unchanged.
        """
        self.tracker.track(entry)
        entry.state = WIRE
        if not entry.mandatory and self.dedup_header is None:
            return None
        headers = dict(entry.base.headers or {})
        if entry.mandatory:  # its return is matched by this, whatever its message_id
            headers[ATTEMPT_HEADER] = attempt_tag(entry.key)
        if self.dedup_header is not None:
            headers[self.dedup_header] = entry.message_id
        return headers

    def write(
        self,
        channel: int,
        frame_max: int,
        out: list[bytes | memoryview],
        broker: BrokerLimits = ANY_BROKER,
    ) -> tuple[int, list[E]]:
        """Append the frames of the next batch to ``out``: (messages written, resolved
        entries), by the rules of :meth:`next_run`, :meth:`sent`, :meth:`mark_sent` and
        :meth:`unmark_sent`.

        At most :data:`BATCH_COUNT` messages or :data:`BATCH_BYTES` body bytes; bodies are split
        at ``frame_max``. A message whose frames cannot be encoded (a gap in ``publish()``'s
        checks), or that ``broker`` (the connected broker's limits) refuses because it was
        taken before the broker was known, is taken back and fails alone with
        :class:`MessageRejected`; the batch goes on.
        """
        count = size = 0
        failed: list[E] = []
        encoder = self._encoder
        if (
            encoder is None
            or encoder.channel != channel
            or encoder.frame_max != frame_max
            or encoder.broker is not broker
        ):
            encoder = self._encoder = PublishEncoder(channel, frame_max, broker)
        encode = encoder.encode
        while count < BATCH_COUNT and size < BATCH_BYTES:
            entries, as_made = self.next_run(BATCH_COUNT - count, BATCH_BYTES - size)
            if not entries:
                break
            count += len(entries)
            if as_made:
                # frames that do not depend on the delivery tag: nothing to take back if
                # encoding fails, and the run's publishes are recorded together after
                written: list[E] = []
                keep = written.append
                try:
                    for entry in entries:
                        try:
                            encode(entry, out)
                        except ENCODE_ERRORS as exc:
                            failed.append(self.fail(entry, _unencodable(entry, exc)))
                            continue
                        keep(entry)
                        size += entry.size
                finally:  # what went into out is recorded, whatever happens
                    self.sent(written)
            else:
                [entry] = entries
                headers = self.mark_sent(entry)
                mark = len(out)
                try:
                    publish_frames(channel, entry, headers, frame_max, out, broker=broker)
                except ENCODE_ERRORS as exc:
                    del out[mark:]
                    self.unmark_sent(entry)
                    failed.append(self.fail(entry, _unencodable(entry, exc)))
                    continue
                size += entry.size
        return count - len(failed), failed

    # --- frames from the broker ---------------------------------------------------------------

    def on_ack(self, generation: int, tag: int, multiple: bool, now: float) -> list[E]:
        """``basic.ack`` on the channel of ``generation``."""
        settled = self.tracker.pop_settled(generation, tag, multiple)
        if not settled:
            return settled
        resolved: list[E] = []
        latencies = self.counters.latencies
        confirmed = 0
        for entry in settled:
            if entry.state is not WIRE:  # expired or closed meanwhile; already resolved
                continue
            if entry.returned is not None or entry.isolated:
                done = self._resolve_one(entry, True, now)
                if done is not None:
                    resolved.append(done)
                continue
            # _finish() for a confirm, inlined: this loop runs for every confirmed message.
            # Twin of _finish (its state, live count and counters): kept in step by
            # tests/core/test_engine_properties.py::test_engine_against_model, whose
            # invariants counts_match and stats_count_what_happened check both paths.
            entry.state = DONE
            latencies.append(now - entry.accepted)
            entry.raw_outcome = CONFIRMED  # its Confirmation is built if asked for
            resolved.append(entry)
            confirmed += 1
        self._live -= confirmed
        self.counters.confirmed += confirmed
        # Let go of what was resolved at the front at once: an entry holds its future and
        # outcome, which the garbage collector walks for as long as they are referenced.
        fifo = self._fifo
        while fifo and fifo[0].state is DONE:
            fifo.popleft()
        return resolved

    def on_nack(self, generation: int, tag: int, multiple: bool, now: float) -> list[E]:
        """``basic.nack``: retried under the nack policy (with backoff), or failed."""
        resolved: list[E] = []
        for entry in self.tracker.pop_settled(generation, tag, multiple):
            if entry.state is WIRE:
                done = self._resolve_one(entry, False, now)
                if done is not None:
                    resolved.append(done)
        return resolved

    def on_return(
        self,
        attempt: object,
        reply_code: int,
        reply_text: str,
        *,
        returned: tuple[object, str, str, bytes, object] | None = None,
        generation: int | None = None,
    ) -> None:
        """``basic.return``; ``attempt`` is the returned message's attempt header value (None
        when it has none), ``returned`` its (message_id, exchange, routing key, body, headers),
        ``generation`` the channel's it came on (see ConfirmTracker.on_return)."""
        self.tracker.on_return(
            attempt, reply_code, reply_text, returned=returned, generation=generation
        )

    def on_channel_lost(self, blame: tuple[int, str] | None, now: float) -> list[E]:
        """The channel is gone, its connection still open; its unconfirmed messages go out
        again on the next one, first and in their original order.

        ``blame`` is the (reply code, reply text) of a close that a message caused (404 missing
        exchange, 406 oversize, ...; :meth:`Supervisor.channel_closed` decides), None when the
        close blames none. The message its text names fails with :class:`MessageRejected`; when
        the text names none, the culprit is found as for a connection's
        (:meth:`on_connection_lost`).
        """
        unconfirmed = self.tracker.new_generation()
        if blame is None:
            return self._requeue(unconfirmed, None, 0, "")
        reply_code, reply_text = blame
        culprit = _find_culprit(unconfirmed, reply_code, reply_text)
        if culprit is None:
            return self._isolate(unconfirmed, reply_code, reply_text)
        return self._requeue(unconfirmed, culprit, reply_code, reply_text)

    def on_connection_lost(self, blame: tuple[int, str] | None, now: float) -> list[E]:
        """The connection is gone, and its channel with it; its unconfirmed messages go out
        again on the next connection, first and in their original order.

        ``blame`` is the broker's ``connection.close`` (code, text) when something a publish
        carried caused it (501 frame error, 502 syntax error, 505 unexpected frame, 541 internal
        error; :meth:`Supervisor.connection_lost` decides), else None. Such a close has a
        culprit, but the broker does not name it: a message alone on the wire is it, and fails
        with :class:`MessageRejected`; when several were in flight, each is marked and sent
        alone from now on, so the next such close (if one comes) names its culprit.
        """
        unconfirmed = self.tracker.new_generation()
        if blame is None:
            return self._requeue(unconfirmed, None, 0, "")
        return self._isolate(unconfirmed, *blame)

    def _isolate(self, unconfirmed: list[E], reply_code: int, reply_text: str) -> list[E]:
        wire = [e for e in unconfirmed if e.state is WIRE]
        if len(wire) == 1:
            return self._requeue(wire, wire[0], reply_code, reply_text)
        for entry in wire:
            if not entry.isolated:
                entry.isolated = True
                self._isolated += 1
        self._probe = None
        return self._requeue(wire, None, reply_code, reply_text)

    def _requeue(
        self,
        unconfirmed: list[E],
        culprit: E | None,
        reply_code: int,
        reply_text: str,
    ) -> list[E]:
        resolved: list[E] = []
        if culprit is not None:
            error = MessageRejected(culprit.message, culprit.attempts, reply_code, reply_text)
            resolved.append(self._finish(culprit, error))
        again = [e for e in unconfirmed if e.state is WIRE]
        for entry in again:
            entry.state = WAITING
        self.counters.republished += len(again)
        if self.on_resend is not None:
            for entry in again:
                self.on_resend(entry, "republish")
        self._sendq.extendleft(reversed(again))
        return resolved

    # --- time ---------------------------------------------------------------------------------

    def tick(self, now: float) -> list[E]:
        """Move due nack retries back to the send queue and expire messages past deadline."""
        retry = self._retry
        while retry and retry[0][0] <= now:
            _, _, entry = heapq.heappop(retry)
            if entry.state is BACKOFF:
                entry.state = WAITING
                self._sendq.append(entry)
        resolved: list[E] = []
        fifo = self._fifo
        while fifo and (fifo[0].state is DONE or fifo[0].deadline <= now):
            entry = fifo.popleft()
            if entry.state is not DONE:
                self.tracker.discard(entry)
                resolved.append(
                    self._finish(
                        entry, DeliveryTimeout(entry.message, entry.attempts, self.delivery_timeout)
                    )
                )
        self._compact()
        return resolved

    def _compact(self) -> None:
        # Resolved entries leave the deadline queue lazily: from the left as they come up, and
        # all at once when they outnumber the live ones 4 to 1 (amortized O(1) per message).
        # Without this a resolved message would stay referenced until the oldest live one's
        # deadline, since the timer only fires for deadlines and retries.
        fifo = self._fifo
        while fifo and fifo[0].state is DONE:
            fifo.popleft()
        if len(fifo) > 1024 and len(fifo) > 4 * self._live:
            self._fifo = deque(e for e in fifo if e.state is not DONE)

    def next_wakeup(self) -> float | None:
        """The earliest time :meth:`tick` has something to do (None: nothing pending)."""
        self._compact()
        due = self._fifo[0].deadline if self._fifo else None
        if self._retry:
            retry = self._retry[0][0]
            return retry if due is None or retry < due else due
        return due

    def close_all(self, reason: str = "") -> list[E]:
        """Fail every unresolved message with :class:`PublisherClosed`."""
        pending = [e for e in self._fifo if e.state is not DONE]
        for entry in pending:
            self.tracker.discard(entry)
        resolved = [
            self._finish(e, PublisherClosed(e.message, e.attempts, reason)) for e in pending
        ]
        self._fifo.clear()
        self._sendq.clear()
        self._retry.clear()
        return resolved

    def fail(self, entry: E, error: PublishError) -> E:
        """Fail one unresolved entry that is not on the wire (it could not be written)."""
        self.tracker.discard(entry)
        return self._finish(entry, error)

    # --- internals ----------------------------------------------------------------------------

    def _resolve_one(self, entry: E, acked: bool, now: float) -> E | None:
        """Settle one entry that was on the wire, acked or nacked: resolved (returned, failed)
        or None (retried)."""
        if acked:
            if entry.returned is None:
                self.counters.latencies.append(now - entry.accepted)
                return self._finish(entry, new_confirmation(entry.message_id, entry.attempts))
            code, text = entry.returned
            return self._finish(entry, MessageReturned(entry.message, entry.attempts, code, text))
        entry.nacks += 1
        self.counters.nacked += 1
        delay = self.nack_policy.delay(entry.nacks, self._rng)
        if (
            self.nack_policy.allows(entry.nacks, now - entry.accepted)
            and now + delay < entry.deadline
        ):
            entry.state = BACKOFF
            self._retry_seq += 1
            heapq.heappush(self._retry, (now + delay, self._retry_seq, entry))
            if self.on_resend is not None:
                self.on_resend(entry, "retry")
            return None
        return self._finish(entry, MessageNacked(entry.message, entry.attempts))

    def _finish(self, entry: E, outcome: Confirmation | PublishError) -> E:
        # Inlined for a plain confirm in on_ack (its twin there): change both together
        # (tests/core/test_engine_properties.py::test_engine_against_model keeps them in step)
        entry.state = DONE
        self._live -= 1
        if entry.isolated:
            self._isolated -= 1
        counters = self.counters
        if isinstance(outcome, Confirmation):
            counters.confirmed += 1
        elif isinstance(outcome, MessageNacked):
            counters.failed_nacked += 1
        elif isinstance(outcome, MessageReturned):
            counters.returned += 1
        elif isinstance(outcome, MessageRejected):
            counters.rejected += 1
        elif isinstance(outcome, DeliveryTimeout):
            counters.timed_out += 1
        else:
            counters.closed += 1
        entry.raw_outcome = outcome
        return entry

    def stats(self) -> Stats:
        """A snapshot of the counters (safe to call from another thread)."""
        for _ in range(5):
            try:
                return self.counters.snapshot(self._live)
            except RuntimeError:  # the deque of latencies changed while being copied
                continue
        return self.counters.snapshot(self._live)


def _find_culprit(unconfirmed: list[E], reply_code: int, reply_text: str) -> E | None:
    """The first in-flight message the broker's reply text points at, if it names one."""
    match = _EXCHANGE_IN_TEXT.search(reply_text)
    if match and reply_code in (403, 404):
        name = match.group(1).replace("''", "'")
        if name == "amq.default":
            name = ""
        return next((e for e in unconfirmed if e.exchange == name), None)
    match = _SIZE_IN_TEXT.search(reply_text)
    if match and reply_code == 406:
        size = int(match.group(1))
        return next((e for e in unconfirmed if e.size == size), None)
    return None
