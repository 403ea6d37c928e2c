"""PublishEngine against a naive model, with a fake clock.

Random interleavings of accept / send / ack / nack (single, multiple, stale) / return / channel
loss (no code, 320, 404 naming an exchange some messages target, 406 naming a body size, LavinMQ's
406 low disk) / tick / close_all. The model is a list of messages, a send queue and a dict of the
attempts on the wire; each answer of the engine is compared with the model's, and each message
must be resolved exactly once over the whole run.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.engine import PublishEngine
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import (
    DeliveryTimeout,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    PublisherClosed,
)
from reliable_amqp._core.message import Confirmation, OutgoingMessage
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.supervisor import is_permanent_channel_close
from reliable_amqp._core.tracker import ATTEMPT_HEADER
from support.engine import accept

TIMEOUT = 10.0
# Dyadic numbers only, so that the model's float arithmetic is exactly the engine's.
INITIAL_DELAY, MAX_DELAY, JITTER, RNG = 0.5, 2.0, 0.5, 0.5
DEDUP = "x-dedup-id"
NOT_FOUND_X = "NOT_FOUND - no exchange 'X' in vhost '/'"

CHANNEL_CLOSES = [
    (None, "connection lost"),
    (320, "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"),
    (404, NOT_FOUND_X),
    (404, "NOT_FOUND - no exchange 'nobody-sends-here' in vhost '/'"),
    (406, "PRECONDITION_FAILED - message size {size} is larger than configured max size 0"),
    (406, "PRECONDITION_FAILED - disk space low"),
]


def _blame(code: int | None, text: str) -> tuple[int, str] | None:
    """What the supervisor tells the engine of a channel close (Supervisor.channel_closed)."""
    if code is not None and is_permanent_channel_close(code, text):
        return code, text
    return None


def nack_delay(nacks: int) -> float:
    delay: float = min(MAX_DELAY, INITIAL_DELAY * 2 ** (nacks - 1)) + JITTER * RNG
    return delay


def _next(engine: PublishEngine[Entry[int]]) -> Entry[int] | None:
    """The next message :meth:`PublishEngine.next_run` gives, taken alone."""
    taken, _ = engine.next_run(1, 1)
    return taken[0] if taken else None


@dataclass
class Msg:
    """The model of one accepted message."""

    handle: int
    message: OutgoingMessage
    accepted: float
    deadline: float
    state: str = "waiting"  # waiting, wire, backoff, done
    attempts: int = 0
    nacks: int = 0
    isolated: bool = False
    returned: tuple[int, str] | None = None
    retry_at: float = 0.0
    tags: list[str] = field(default_factory=list)


class EngineMachine(RuleBasedStateMachine):
    @initialize(
        max_attempts=st.sampled_from([1, 2, 3]),
        dedup=st.booleans(),
    )
    def setup(self, max_attempts: int, dedup: bool) -> None:
        self.max_attempts = max_attempts
        self.dedup = dedup
        policy = RetryPolicy(
            max_attempts=max_attempts,
            initial_delay=INITIAL_DELAY,
            max_delay=MAX_DELAY,
            multiplier=2.0,
            jitter=JITTER,
        )
        self.engine: PublishEngine[Entry[int]] = PublishEngine(
            delivery_timeout=TIMEOUT,
            nack_policy=policy,
            dedup_header=DEDUP if dedup else None,
            rng=lambda: RNG,
        )
        self.now = 0.0
        self.msgs: list[Msg] = []
        self.entries: dict[int, Entry[int]] = {}
        self.generation = 0
        self.seq = 0
        self.wire: dict[int, Msg] = {}  # seq -> message, current generation
        self.queue: deque[Msg] = deque()
        self.retries: list[tuple[float, int, Msg]] = []
        self.retry_order = 0
        self.resolved: Counter[int] = Counter()
        self.outcomes: dict[int, type] = {}
        self.republished = 0
        self.probe: Msg | None = None  # the isolated message sent alone, while isolating

    # --- model helpers -----------------------------------------------------------------------

    def _isolating(self) -> bool:
        return any(m.isolated and m.state != "done" for m in self.msgs)

    def _next_expected(self) -> Msg | None:
        """What next_run() must give next: the queue's head, except while isolating, where
        an isolated message goes only onto an empty wire, and nothing follows it until it is
        settled."""
        if not self.queue:
            return None
        if not self._isolating():
            return self.queue[0]
        if self.probe is not None and self.probe.state == "wire":
            return None
        head = self.queue[0]
        if head.isolated and self.wire:
            return None
        return head

    def _take_expected(self) -> Msg | None:
        expected = self._next_expected()
        if self._isolating() and not (self.probe is not None and self.probe.state == "wire"):
            self.probe = None
        if expected is not None:
            self.queue.popleft()
            if expected.isolated:
                self.probe = expected
        return expected

    def _live(self) -> list[Msg]:
        return [m for m in self.msgs if m.state != "done"]

    def _done(self, msg: Msg, expected: list[tuple[Msg, type]], cls: type) -> None:
        msg.state = "done"
        expected.append((msg, cls))

    def _check(self, got: list[Entry[int]], expected: list[tuple[Msg, type]]) -> None:
        assert [(r.handle, type(r.outcome)) for r in got] == [
            (m.handle, cls) for m, cls in expected
        ]
        for r in got:
            msg = self.msgs[r.handle]
            assert r is self.entries[msg.handle]
            self.resolved[msg.handle] += 1
            self.outcomes[msg.handle] = type(r.outcome)
            assert self.resolved[msg.handle] == 1, f"message {msg.handle} resolved twice"
            result = r.outcome
            assert r.ok is isinstance(result, Confirmation)
            if isinstance(result, Confirmation):
                # only for a message whose latest attempt was acked and not returned
                assert result.message_id == msg.message.message_id
                assert result.attempts == msg.attempts >= 1
                assert msg.returned is None
                continue
            assert result is not None  # resolved: a Confirmation or a PublishError
            assert result.message is msg.message
            assert result.attempts == msg.attempts
            if isinstance(result, MessageNacked):
                spent = msg.nacks >= self.max_attempts
                assert spent or self.now + nack_delay(msg.nacks) >= msg.deadline
            elif isinstance(result, DeliveryTimeout):
                assert self.now >= msg.deadline
                assert result.timeout == TIMEOUT
            elif isinstance(result, MessageReturned):
                assert (result.reply_code, result.reply_text) == msg.returned == (312, "NO_ROUTE")
            elif isinstance(result, MessageRejected):
                assert result.reply_code in (0, 404, 406)  # 0: could not be encoded
            else:
                assert isinstance(result, PublisherClosed)

    def _settle(self, generation: int, tag: int, multiple: bool) -> list[Msg]:
        if generation != self.generation or tag <= 0:
            return []
        if multiple:
            seqs = sorted(s for s in self.wire if s <= tag)
        else:
            seqs = [tag] if tag in self.wire else []
        return [self.wire.pop(s) for s in seqs]

    def _target(self, data: st.DataObject) -> tuple[int, int]:
        """Mostly a tag on the wire; sometimes any tag, of this generation or the one before."""
        if self.wire and data.draw(st.integers(0, 3), label="wild") > 0:
            return self.generation, data.draw(st.sampled_from(sorted(self.wire)), label="tag")
        generation = data.draw(
            st.sampled_from([self.generation, self.generation - 1]), label="generation"
        )
        return generation, data.draw(st.integers(0, self.seq + 2), label="tag")

    def _unwire(self, msg: Msg) -> None:
        for seq, m in list(self.wire.items()):
            if m is msg:
                del self.wire[seq]

    # --- rules -------------------------------------------------------------------------------

    @rule(
        batch=st.lists(
            st.tuples(
                st.booleans(),
                st.booleans(),
                st.integers(1, 6),
                st.sampled_from([None, {"app": "t", "n": 1}]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def accept(self, batch: list[tuple[bool, bool, int, Any]]) -> None:
        for to_x, mandatory, size, headers in batch:
            handle = len(self.msgs)
            message = build_message(
                "X" if to_x else "good",
                "rk",
                bytes(size),
                mandatory=mandatory,
                properties={"headers": headers} if headers else None,
            )
            entry = accept(self.engine, message, handle, self.now)
            assert entry.message == message and entry.handle == handle
            assert entry.deadline == self.now + TIMEOUT
            msg = Msg(handle, message, self.now, self.now + TIMEOUT)
            self.msgs.append(msg)
            self.entries[handle] = entry
            self.queue.append(msg)

    @rule(count=st.integers(1, 8))
    def send(self, count: int) -> None:
        for _ in range(count):
            self._send_one()

    @rule(count=st.integers(1, 8))
    def send_batch(self, count: int) -> None:
        """A writer's batch: next_run() gives a run that goes out as made, or one message with
        headers of its own (a dedup header, BCC's attempt header), marked one by one here."""
        taken, as_made = self.engine.next_run(count, 1 << 30)
        for entry in taken:
            expected = self._take_expected()
            assert expected is not None and entry is self.entries[expected.handle]
            assert as_made is not self._alone(expected)
            self._sent(entry, expected)
        if not as_made:
            assert len(taken) == 1
        elif len(taken) < count:  # the model agrees nothing more goes in this run
            following = self._next_expected()
            assert following is None or self._alone(following)

    def _alone(self, msg: Msg) -> bool:
        """Whether the message goes out with headers of its own, in a run of its own."""
        headers = msg.message.base.headers or {}
        return self.dedup or (msg.message.mandatory and "BCC" in headers)

    def _send_one(self) -> None:
        entry = _next(self.engine)
        expected = self._take_expected()
        if expected is None:
            assert entry is None
            return
        assert entry is self.entries[expected.handle]
        self._sent(entry, expected)

    def _sent(self, entry: Entry[int], expected: Msg) -> None:
        headers = self.engine.mark_sent(entry)
        self.seq += 1
        self.wire[self.seq] = expected
        expected.state = "wire"
        expected.attempts += 1
        expected.returned = None
        message = expected.message
        # republished with the same message (and so the same message_id) every time
        assert entry.message == message and entry.attempts == expected.attempts
        if not message.mandatory and not self.dedup:
            assert headers is None
            return
        want = dict(message.properties.headers or {})
        if message.mandatory:
            want[ATTEMPT_HEADER] = f"{self.generation}.{self.seq}"
            expected.tags.append(want[ATTEMPT_HEADER])
        if self.dedup:
            want[DEDUP] = message.message_id
        assert dict(headers or {}) == want

    @precondition(lambda self: self._next_expected() is not None)
    @rule()
    def send_fails_to_encode(self) -> None:
        """The adapter could not encode the message: nothing was written, it fails alone."""
        entry = _next(self.engine)
        msg = self._take_expected()
        assert msg is not None and entry is self.entries[msg.handle]
        self.engine.mark_sent(entry)
        self.engine.unmark_sent(entry)
        assert entry.key == -1
        assert entry.attempts == msg.attempts
        expected: list[tuple[Msg, type]] = []
        self._done(msg, expected, MessageRejected)
        error = MessageRejected(msg.message, entry.attempts, 0, "could not be encoded")
        self._check([self.engine.fail(entry, error)], expected)

    @precondition(lambda self: any(m.state in ("waiting", "backoff") for m in self.msgs))
    @rule(data=st.data())
    def fail_one_not_on_the_wire(self, data: st.DataObject) -> None:
        msg = data.draw(
            st.sampled_from([m for m in self.msgs if m.state in ("waiting", "backoff")])
        )
        self.queue = deque(m for m in self.queue if m is not msg)
        expected: list[tuple[Msg, type]] = []
        self._done(msg, expected, PublisherClosed)
        error = PublisherClosed(msg.message, msg.attempts, "failed by the adapter")
        self._check([self.engine.fail(self.entries[msg.handle], error)], expected)

    @rule(data=st.data(), multiple=st.booleans())
    def ack(self, data: st.DataObject, multiple: bool) -> None:
        self._ack(*self._target(data), multiple)

    def _ack(self, generation: int, tag: int, multiple: bool) -> None:
        expected: list[tuple[Msg, type]] = []
        for msg in self._settle(generation, tag, multiple):
            self._done(msg, expected, MessageReturned if msg.returned else Confirmation)
        self._check(self.engine.on_ack(generation, tag, multiple, self.now), expected)

    @rule(data=st.data(), multiple=st.booleans())
    def nack(self, data: st.DataObject, multiple: bool) -> None:
        self._nack(*self._target(data), multiple)

    def _nack(self, generation: int, tag: int, multiple: bool) -> None:
        expected: list[tuple[Msg, type]] = []
        for msg in self._settle(generation, tag, multiple):
            msg.nacks += 1
            delay = nack_delay(msg.nacks)
            if msg.nacks < self.max_attempts and self.now + delay < msg.deadline:
                msg.state = "backoff"
                msg.retry_at = self.now + delay
                self.retry_order += 1
                self.retries.append((msg.retry_at, self.retry_order, msg))
            else:
                self._done(msg, expected, MessageNacked)
        self._check(self.engine.on_nack(generation, tag, multiple, self.now), expected)

    @precondition(lambda self: any(m.message.mandatory for m in self.wire.values()))
    @rule(data=st.data())
    def basic_return(self, data: st.DataObject) -> None:
        msg = data.draw(st.sampled_from([m for m in self.wire.values() if m.message.mandatory]))
        self.engine.on_return(msg.tags[-1].encode(), 312, "NO_ROUTE")
        msg.returned = (312, "NO_ROUTE")

    @precondition(
        lambda self: any(len(m.tags) > 1 or m.state != "wire" for m in self.msgs if m.tags)
    )
    @rule(data=st.data())
    def stale_return(self, data: st.DataObject) -> None:
        """A return for an earlier attempt: ignored (the ack that follows it is not ours)."""
        msg = data.draw(st.sampled_from([m for m in self.msgs if m.tags]))
        old = msg.tags[:-1] if msg.state == "wire" else msg.tags
        if old:
            self.engine.on_return(data.draw(st.sampled_from(old)), 312, "NO_ROUTE")

    @rule(close=st.sampled_from(CHANNEL_CLOSES), size=st.integers(1, 6))
    def channel_lost(self, close: tuple[int | None, str], size: int) -> None:
        code, text = close[0], close[1].format(size=size)
        unconfirmed = [self.wire[s] for s in sorted(self.wire)]
        self.wire.clear()
        self.generation += 1
        self.seq = 0
        expected: list[tuple[Msg, type]] = []
        if code in (404, 406) and "disk" not in text:
            if code == 404:
                culprit = next((m for m in unconfirmed if m.message.exchange == "X"), None)
                culprit = culprit if "'X'" in text else None
            else:
                culprit = next((m for m in unconfirmed if len(m.message.body) == size), None)
            if culprit is not None:
                blamed = [culprit]
            elif len(unconfirmed) == 1:  # alone on the wire: it did it
                blamed = unconfirmed
            else:  # each goes alone from now on, so the next such close names it
                blamed = []
                for m in unconfirmed:
                    m.isolated = True
                self.probe = None
            for m in blamed:
                self._done(m, expected, MessageRejected)
        again = [m for m in unconfirmed if m.state == "wire"]
        for m in again:
            m.state = "waiting"
        self.republished += len(again)
        self.queue.extendleft(reversed(again))
        self._check(self.engine.on_channel_lost(_blame(code, text), self.now), expected)
        assert self.engine.tracker.generation == self.generation
        assert len(self.engine.tracker) == 0

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def tick_to_a_boundary(self, data: st.DataObject) -> None:
        """Jump to a deadline, just before one, or to a retry time: where off-by-ones hide."""
        live = self._live()
        times = {m.deadline + off for m in live for off in (-2.5, -2.25, -0.25, 0.0)}
        times |= {m.retry_at for m in live if m.state == "backoff"}
        later = sorted(t for t in times if t > self.now)
        if later:
            self.tick(data.draw(st.sampled_from(later)) - self.now)

    @rule(dt=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        due = sorted((r for r in self.retries if r[0] <= self.now), key=lambda r: r[:2])
        self.retries = [r for r in self.retries if r[0] > self.now]
        for _, _, msg in due:
            if msg.state == "backoff":
                msg.state = "waiting"
                self.queue.append(msg)
        expected: list[tuple[Msg, type]] = []
        for msg in self._live():
            if msg.deadline <= self.now:
                self._unwire(msg)
                self._done(msg, expected, DeliveryTimeout)
        self.queue = deque(m for m in self.queue if m.state != "done")
        self._check(self.engine.tick(self.now), expected)

    @rule(draw=st.integers(0, 9))
    def close_all_sometimes(self, draw: int) -> None:
        """The publisher closes (rarely: one draw in ten, or nothing would be left to test)."""
        if draw == 7:
            self.close_all()

    def close_all(self) -> None:
        expected: list[tuple[Msg, type]] = []
        for msg in self._live():
            self._done(msg, expected, PublisherClosed)
        self.wire.clear()  # discarded: acks for them later are ignored; the seq goes on
        self.queue.clear()
        self.retries.clear()
        self._check(self.engine.close_all("test"), expected)

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def counts_match(self) -> None:
        live = self._live()
        assert len(self.engine) == len(live)
        assert sum(self.resolved.values()) == len(self.msgs) - len(live)
        assert len(self.engine.tracker) == len(self.wire)
        assert [e.handle for e in self.engine.tracker] == [
            self.wire[s].handle for s in sorted(self.wire)
        ]
        if self.queue:
            assert self.engine.has_sendable()

    @invariant()
    def stats_count_what_happened(self) -> None:
        stats = self.engine.stats()
        by_kind = Counter(self.outcomes.values())
        assert stats.published == len(self.msgs)
        assert stats.in_flight == len(self._live())
        assert stats.confirmed == by_kind[Confirmation]
        assert stats.failed_nacked == by_kind[MessageNacked]
        assert stats.returned == by_kind[MessageReturned]
        assert stats.rejected == by_kind[MessageRejected]
        assert stats.timed_out == by_kind[DeliveryTimeout]
        assert stats.closed == by_kind[PublisherClosed]
        assert stats.nacked == sum(m.nacks for m in self.msgs)
        assert stats.republished == self.republished

    @invariant()
    def next_wakeup_is_the_earliest_event(self) -> None:
        # retries of messages failed while in backoff stay in the heap until due: a spurious
        # but harmless wakeup
        times = [m.deadline for m in self._live()] + [r[0] for r in self.retries]
        assert self.engine.next_wakeup() == (min(times) if times else None)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        self.close_all()
        assert len(self.engine) == 0
        assert _next(self.engine) is None
        assert sorted(self.resolved) == [m.handle for m in self.msgs]
        assert set(self.resolved.values()) <= {1}


EngineMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_engine_against_model = EngineMachine.TestCase


# --- fixed scenarios: the paths above, one at a time -------------------------------------------


def _engine(max_attempts: int = 3) -> PublishEngine[Entry[int]]:
    policy = RetryPolicy(
        max_attempts=max_attempts,
        initial_delay=INITIAL_DELAY,
        max_delay=MAX_DELAY,
        multiplier=2.0,
        jitter=JITTER,
    )
    return PublishEngine(delivery_timeout=TIMEOUT, nack_policy=policy, rng=lambda: RNG)


def _accept(
    engine: PublishEngine[Entry[int]], n: int, exchange: str = "good", now: float = 0.0
) -> list[Entry[int]]:
    return [
        accept(engine, build_message(exchange, "rk", bytes(i + 1)), len(engine) + i, now)
        for i in range(n)
    ]


def _send_all(engine: PublishEngine[Entry[int]]) -> list[Entry[int]]:
    sent = []
    while (entry := _next(engine)) is not None:
        engine.mark_sent(entry)
        sent.append(entry)
    return sent


def test_channel_loss_republishes_unconfirmed_first_in_order_with_same_ids() -> None:
    engine = _engine()
    first = _accept(engine, 4)
    assert _send_all(engine) == first
    assert [r for r in engine.on_ack(0, 2, False, 0.0)] == [first[1]]
    later = _accept(engine, 2)
    ids = [e.message.message_id for e in first]
    assert engine.on_channel_lost(None, 0.0) == []
    again = _send_all(engine)
    assert again == [first[0], first[2], first[3], *later]
    assert [e.message.message_id for e in again[:3]] == [ids[0], ids[2], ids[3]]
    assert [e.attempts for e in again] == [2, 2, 2, 1, 1]
    assert [r.ok for r in engine.on_ack(1, 5, True, 0.0)] == [True] * 5
    assert len(engine) == 0


def test_404_rejects_the_message_for_the_missing_exchange_and_republishes_the_rest() -> None:
    engine = _engine()
    good, bad, good2, bad2 = (
        _accept(engine, 1)[0],
        _accept(engine, 1, "X")[0],
        _accept(engine, 1)[0],
        _accept(engine, 1, "X")[0],
    )
    _send_all(engine)
    [rejected] = engine.on_channel_lost((404, NOT_FOUND_X), 1.0)
    assert rejected is bad
    assert isinstance(rejected.outcome, MessageRejected)
    assert rejected.outcome.reply_code == 404
    assert _send_all(engine) == [good, good2, bad2]
    assert len(engine) == 3


def test_channel_close_naming_no_message_fails_the_message_alone_on_the_wire() -> None:
    engine = _engine()
    [entry] = _accept(engine, 1)
    text = "NOT_FOUND - no exchange 'elsewhere' in vhost '/'"
    _send_all(engine)
    [rejected] = engine.on_channel_lost((404, text), 0.0)
    assert rejected is entry and isinstance(rejected.outcome, MessageRejected)
    assert rejected.outcome.attempts == 1


def test_channel_close_naming_no_message_isolates_then_names_the_culprit() -> None:
    engine = _engine()
    entries = _accept(engine, 3)
    text = "PRECONDITION_FAILED - unacceptable_type_in_header"
    _send_all(engine)
    assert engine.on_channel_lost((406, text), 0.0) == []  # three in flight: who did it?
    assert engine.isolating
    first = _next(engine)
    assert first is entries[0]
    engine.mark_sent(first)
    assert _next(engine) is None  # it is alone on the wire until settled
    [ok] = engine.on_ack(engine.tracker.generation, 1, False, 1.0)
    assert ok is entries[0] and ok.ok
    second = _next(engine)
    assert second is entries[1]
    engine.mark_sent(second)
    [rejected] = engine.on_channel_lost((406, text), 2.0)  # alone: second did it
    assert rejected is entries[1] and isinstance(rejected.outcome, MessageRejected)
    assert _send_all(engine) == [entries[2]]


@pytest.mark.parametrize(
    "code, text",
    [
        (None, "connection lost"),
        (320, "CONNECTION_FORCED - shutdown"),
        (406, "PRECONDITION_FAILED - disk space low"),
        (541, "INTERNAL_ERROR"),
    ],
)
def test_channel_closes_that_blame_no_message_reject_nothing(code: int | None, text: str) -> None:
    engine = _engine()
    entries = _accept(engine, 2, "X")
    _send_all(engine)
    assert engine.on_channel_lost(_blame(code, text), 0.0) == []
    assert _send_all(engine) == entries


def test_406_with_a_size_rejects_the_message_of_that_size() -> None:
    engine = _engine()
    entries = _accept(engine, 3)  # bodies of 1, 2 and 3 bytes
    _send_all(engine)
    text = "PRECONDITION_FAILED - message size 2 is larger than configured max size 1"
    [rejected] = engine.on_channel_lost((406, text), 0.0)
    assert rejected is entries[1]


def test_nack_is_retried_after_backoff_then_confirmed() -> None:
    engine = _engine()
    [entry] = _accept(engine, 1)
    _send_all(engine)
    assert engine.on_nack(0, 1, False, 1.0) == []
    assert engine.next_wakeup() == 1.0 + nack_delay(1)
    assert engine.tick(1.0 + nack_delay(1) - 0.25) == []
    assert _next(engine) is None
    assert engine.tick(1.0 + nack_delay(1)) == []
    assert _send_all(engine) == [entry]
    [done] = engine.on_ack(0, 2, False, 2.0)
    assert done.outcome == Confirmation(entry.message.message_id, 2)


def test_nack_fails_when_the_policy_is_spent() -> None:
    engine = _engine(max_attempts=2)
    _accept(engine, 1)
    _send_all(engine)
    assert engine.on_nack(0, 1, False, 0.0) == []
    engine.tick(5.0)
    _send_all(engine)
    [done] = engine.on_nack(0, 2, False, 5.0)
    assert isinstance(done.outcome, MessageNacked)
    assert done.outcome.attempts == 2


def test_nack_fails_at_once_when_the_retry_would_start_after_the_deadline() -> None:
    engine = _engine(max_attempts=5)
    _accept(engine, 2)
    _send_all(engine)
    # the retry would start at 10.0 == deadline: fail now rather than time out later
    [done] = engine.on_nack(0, 1, False, TIMEOUT - nack_delay(1))
    assert isinstance(done.outcome, MessageNacked)
    assert engine.on_nack(0, 2, False, TIMEOUT - nack_delay(1) - 0.25) == []


def test_delivery_timeout_fires_at_the_deadline_not_before() -> None:
    engine = _engine()
    [entry] = _accept(engine, 1, now=1.0)
    _send_all(engine)
    assert engine.next_wakeup() == 1.0 + TIMEOUT
    assert engine.tick(1.0 + TIMEOUT - 0.25) == []
    [done] = engine.tick(1.0 + TIMEOUT)
    assert done is entry and isinstance(done.outcome, DeliveryTimeout)
    assert engine.on_ack(0, 1, False, 20.0) == []  # a late ack changes nothing
    assert len(engine) == 0 and engine.next_wakeup() is None


def test_returned_then_acked_resolves_as_returned_and_a_stale_return_is_ignored() -> None:
    engine = _engine()
    returned = accept(engine, build_message("good", "rk", b"a", mandatory=True), 0, 0.0)
    other = accept(engine, build_message("good", "rk", b"b", mandatory=True), 1, 0.0)
    tags = [engine.mark_sent(e)[ATTEMPT_HEADER] for e in _take(engine, 2)]  # type: ignore[index]
    engine.on_channel_lost(None, 0.0)
    _take_and_send(engine, 2)
    engine.on_return(tags[1], 312, "NO_ROUTE")  # a return for the attempt before the loss
    engine.on_return(f"{engine.tracker.generation}.1", 312, "NO_ROUTE")
    results = engine.on_ack(engine.tracker.generation, 2, True, 0.0)
    assert [(r, type(r.outcome)) for r in results] == [
        (returned, MessageReturned),
        (other, Confirmation),
    ]


def _take(engine: PublishEngine[Entry[int]], n: int) -> list[Entry[int]]:
    taken = [_next(engine) for _ in range(n)]
    assert all(e is not None for e in taken)
    return taken  # type: ignore[return-value]


def _take_and_send(engine: PublishEngine[Entry[int]], n: int) -> None:
    for entry in _take(engine, n):
        engine.mark_sent(entry)


def test_close_all_fails_every_unresolved_message_once() -> None:
    engine = _engine()
    entries = _accept(engine, 4)
    _take_and_send(engine, 3)
    engine.on_nack(0, 1, False, 0.0)  # in backoff
    engine.on_ack(0, 2, False, 0.0)  # confirmed
    results = engine.close_all("bye")
    assert [r for r in results] == [entries[0], entries[2], entries[3]]
    assert all(isinstance(r.outcome, PublisherClosed) for r in results)
    assert all(r.outcome.reason == "bye" for r in results)  # type: ignore[union-attr]
    assert len(engine) == 0
    assert engine.close_all() == [] and _next(engine) is None
    assert engine.tick(100.0) == [] and engine.on_ack(0, 3, True, 0.0) == []
