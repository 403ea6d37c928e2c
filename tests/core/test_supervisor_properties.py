"""Supervisor and Window against naive models, with a fake clock.

(a) The connect plan: random attempts, established or not, losses retriable or not, channels
    opened, clock advances and a close; each answer (which URL, after how long, give up with
    what) is compared with a model that counts failures the simple way.
(b) The window: random takes, releases of random subsets, flushes begun and ended; the model is
    the set of unresolved issue numbers (a barrier's remaining is how many of them are <= its
    mark) and exact counts and bytes.
(c) The supervisor driving its engine, with a window beside it as the adapters keep one: random
    publish / write / ack / nack (single, multiple) / channel close (404 naming an exchange, 320)
    / connection loss / blocked / tick, then a close: every message resolves exactly once and the
    in-flight counts agree all along.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import (
    AmqpConnectionError,
    AuthenticationFailed,
    DeliveryTimeout,
    MessageNacked,
    MessageRejected,
    PublisherClosed,
    RecoveryFailed,
    ReliableAmqpError,
)
from reliable_amqp._core.message import Confirmation, MessageProperties
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.state import State
from reliable_amqp._core.stats import EventKind, PublisherEvent
from reliable_amqp._core.supervisor import GiveUp, Reconnect, Supervisor
from reliable_amqp._core.tracker import unpack_key
from reliable_amqp._core.window import Barrier, Window
from support.engine import accept, entry_for

URLS = ("amqp://a/", "amqp://b/", "amqp://c/")
INITIAL, MAX = 1.0, 8.0
SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)


def base_delay(failures: int) -> float:
    return min(MAX, INITIAL * 2.0 ** (failures - 1))


# --- (a) the connect plan -----------------------------------------------------------------------


class ConnectMachine(RuleBasedStateMachine):
    @initialize(
        urls=st.integers(1, 3),
        max_attempts=st.sampled_from([None, 1, 2, 4, 7]),
        deadline=st.sampled_from([None, 2.0, 5.0, 20.0]),
        borrowed=st.booleans(),
    )
    def setup(
        self, urls: int, max_attempts: int | None, deadline: float | None, borrowed: bool
    ) -> None:
        policy = RetryPolicy(
            max_attempts=max_attempts,
            initial_delay=INITIAL,
            max_delay=MAX,
            multiplier=2.0,
            jitter=0,
            deadline=deadline,
        )
        self.events: list[PublisherEvent] = []
        options = PublisherOptions.create(
            list(URLS[:urls]), connect_policy=policy, on_event=self.events.append
        )
        self.sup: Supervisor[Entry[int]] = Supervisor(options, borrowed=borrowed)
        self.n = urls
        self.max_attempts = max_attempts
        self.deadline = deadline
        self.borrowed = borrowed
        self.now = 0.0
        self.attempts = 0
        self.failures = 0
        self.first_failure = 0.0
        self.opened_this_attempt = False
        self.in_attempt = False
        self.established = False
        self.over = False  # gave up or closed
        self.closing = False

    @precondition(lambda self: not self.in_attempt and not self.over)
    @rule()
    def attempt(self) -> None:
        assert self.sup.next_attempt() == self.attempts % self.n
        self.attempts += 1
        self.in_attempt = True
        self.established = False
        self.opened_this_attempt = False

    @precondition(lambda self: self.in_attempt and not self.established)
    @rule()
    def establish(self) -> None:
        self.established = True

    @precondition(lambda self: self.established and not self.opened_this_attempt)
    @rule()
    def open_channel(self) -> None:
        opened = self.sup.channel_opened()
        if self.closing:  # a channel that opens while closing is not used
            assert opened is False and self.sup.state.state is State.CLOSING
            return
        assert opened is True
        self.opened_this_attempt = True
        assert self.sup.state.state is State.OPEN

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.in_attempt)
    @rule(kind=st.sampled_from(["none", "retriable", "refused"]))
    def lose(self, kind: str) -> None:
        loss: ReliableAmqpError | None = {
            "none": None,
            "retriable": AmqpConnectionError("reset"),
            "refused": AuthenticationFailed("refused"),
        }[kind]
        before = len(self.events)
        resolutions, plan = self.sup.connection_lost(loss, self.now, established=self.established)
        assert resolutions == []
        self.in_attempt = False
        if self.over:  # closing
            assert plan is None and len(self.events) == before
            return
        lost = [e.kind for e in self.events[before:]]
        assert (EventKind.CONNECTION_LOST in lost) is self.established
        if self.opened_this_attempt:
            self.failures = 0
        if self.failures == 0:
            self.first_failure = self.now
        self.failures += 1
        # The deadline is judged with the wait that actually comes next: none inside a
        # failover round (or for a borrowed connection), the backoff after a full round.
        in_round = self.borrowed or self.failures % self.n != 0
        wait = 0.0 if in_round else base_delay(self.failures)
        spent = (self.max_attempts is not None and self.failures >= self.max_attempts) or (
            self.deadline is not None and self.now - self.first_failure + wait > self.deadline
        )
        if loss is not None and not loss.retriable:
            assert isinstance(plan, GiveUp) and plan.error is loss
        elif spent:
            assert isinstance(plan, GiveUp) and isinstance(plan.error, RecoveryFailed)
            cause = plan.error.__cause__
            assert cause is loss if loss is not None else str(cause) == "connection lost"
            assert str(plan.error).startswith(f"gave up connecting after {self.failures} attempts")
        else:
            delay = base_delay(self.failures) if self.failures % self.n == 0 else 0.0
            assert plan == Reconnect(self.attempts % self.n, 0.0 if self.borrowed else delay)
            assert self.sup.state.state is State.RECOVERING and self.sup.fatal is None
            return
        assert self.sup.fatal is plan.error
        assert lost[-1:] == [EventKind.RECOVERY_FAILED]
        self.over = True

    @precondition(lambda self: not self.over)
    @rule()
    def close(self) -> None:
        self.sup.begin_close()
        self.over = self.closing = True
        assert not self.sup.writable

    def teardown(self) -> None:
        if hasattr(self, "sup"):
            self.sup.shutdown()
            self.sup.closed()
            assert self.sup.state.state is State.CLOSED
            assert [e.kind for e in self.events].count(EventKind.CLOSED) == 1


ConnectMachine.TestCase.settings = SETTINGS
test_connect_plan_against_model = ConnectMachine.TestCase


# --- (b) the window -----------------------------------------------------------------------------


@dataclass
class Handle:
    index: int


def resolution(index: int, size: int) -> Entry[Handle]:
    message = build_message("x", "rk", b"")
    outcome = Confirmation(message.message_id, 1)
    return entry_for(message, Handle(index), size=size, index=index, outcome=outcome)


class WindowMachine(RuleBasedStateMachine):
    barriers = Bundle("barriers")

    @initialize(max_count=st.integers(1, 6), max_bytes=st.integers(1, 20))
    def setup(self, max_count: int, max_bytes: int) -> None:
        self.window = Window(max_count, max_bytes)
        self.max_count, self.max_bytes = max_count, max_bytes
        self.unresolved: dict[int, int] = {}  # index -> size
        self.issued = 0
        # barrier -> (its mark, still counted: begun with something pending and not ended)
        self.model: dict[int, tuple[Barrier, int, bool]] = {}
        self.returned: Counter[int] = Counter()

    def _remaining(self, mark: int) -> int:
        return sum(1 for i in self.unresolved if i <= mark)

    @rule(size=st.integers(0, 25))
    def issue(self, size: int) -> None:
        count, used = len(self.unresolved), sum(self.unresolved.values())
        fits = count < self.max_count and (used + size <= self.max_bytes or count == 0)
        assert self.window.fits(size) is fits
        assert self.window.free_slots() == self.max_count - count
        if fits:  # publishers issue only what fits
            self.issued += 1
            assert self.window.issue(size) == self.issued
            self.unresolved[self.issued] = size

    @precondition(lambda self: self.unresolved)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(self.unresolved)), min_size=1, unique=True),
            label="resolved",
        )
        counted_before = {
            key: self._remaining(mark) for key, (_, mark, counted) in self.model.items() if counted
        }
        resolutions = [resolution(i, self.unresolved.pop(i)) for i in chosen]
        cleared = self.window.release(resolutions)
        expected = [
            self.model[key][0]
            for key, before in counted_before.items()
            if before > 0 and self._remaining(self.model[key][1]) == 0
        ]
        assert cleared == expected
        for barrier in cleared:
            self.returned[id(barrier)] += 1
            assert self.returned[id(barrier)] == 1, "a barrier was returned twice"

    @rule(target=barriers)
    def flush(self) -> Barrier:
        barrier = self.window.barrier()
        assert (barrier.mark, barrier.remaining) == (self.issued, len(self.unresolved))
        self.model[id(barrier)] = (barrier, barrier.mark, barrier.remaining > 0)
        return barrier

    @rule(barrier=consumes(barriers))
    def end(self, barrier: Barrier) -> None:
        self.window.end_barrier(barrier)
        _, mark, counted = self.model[id(barrier)]
        if counted:
            self.model[id(barrier)] = (barrier, mark, False)
        self.window.end_barrier(barrier)  # twice is harmless

    @invariant()
    def counts_are_exact(self) -> None:
        if not hasattr(self, "window"):
            return
        assert self.window.count == len(self.unresolved)
        assert self.window.bytes == sum(self.unresolved.values())
        assert self.window.issued == self.issued
        for barrier, mark, counted in self.model.values():
            if counted:
                assert barrier.remaining == self._remaining(mark)


WindowMachine.TestCase.settings = SETTINGS
test_window_against_model = WindowMachine.TestCase


# --- (c) the supervisor with its engine ---------------------------------------------------------

NOT_FOUND_X = "NOT_FOUND - no exchange 'X' in vhost '/'"
FORCED = "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'"
TIMEOUT = 10.0


class SupervisorMachine(RuleBasedStateMachine):
    @initialize(nack_attempts=st.sampled_from([1, 2, 3]), urls=st.integers(1, 3))
    def setup(self, nack_attempts: int, urls: int) -> None:
        nack = RetryPolicy(max_attempts=nack_attempts, initial_delay=0.5, multiplier=2, jitter=0)
        connect = RetryPolicy(max_attempts=None, initial_delay=0.5, jitter=0)
        options = PublisherOptions.create(
            list(URLS[:urls]),
            connect_policy=connect,
            nack_policy=nack,
            delivery_timeout=TIMEOUT,
            max_in_flight=1000,
        )
        self.sup: Supervisor[Entry[Handle]] = Supervisor(options)
        self.window = Window(options.max_in_flight, options.max_in_flight_bytes)
        self.now = 0.0
        self.published = 0
        self.resolved: dict[int, type] = {}
        self.exchange: dict[int, str] = {}
        self.connected = False
        self.channel_open = False
        self.closed = False
        self.sup.next_attempt()
        self.sup.channel_opened()
        self.connected = self.channel_open = True

    def _record(self, resolutions: list[Entry[Handle]]) -> None:
        for r in resolutions:
            index = r.handle.index
            assert index not in self.resolved, f"message {index} resolved twice"
            self.resolved[index] = type(r.outcome)
            if isinstance(r.outcome, Confirmation):
                assert r.outcome.attempts >= 1
            else:
                assert r.outcome is not None  # resolved: a Confirmation or a PublishError
                assert r.outcome.message is r.message  # the message, not the entry
        self.window.release(resolutions)

    @precondition(lambda self: not self.closed)
    @rule(kind=st.sampled_from(["good", "good", "X", "bad"]), size=st.integers(0, 3))
    def publish(self, kind: str, size: int) -> None:
        message = build_message("X" if kind == "X" else "good", "rk", bytes(size))
        if kind == "bad":  # a gap in publish()'s checks: it cannot be encoded
            props = MessageProperties(headers={"k": object()}, message_id="bad")
            message = message.replace(properties=props)
        index = self.window.issue(size)
        accept(self.sup.engine, message, Handle(index), self.now)
        self.published += 1
        self.exchange[index] = kind

    @precondition(lambda self: not self.closed)
    @rule()
    def write(self) -> None:
        out: list[bytes | memoryview] = []
        self.sup.frame_max = 131072  # as the connection negotiated it
        count, failed = self.sup.write(1, out) if self.sup.writable else (0, [])
        assert all(isinstance(r.outcome, MessageRejected) for r in failed)
        assert all(self.exchange[r.handle.index] == "bad" for r in failed)
        assert (count == 0) is (not out)
        self._record(failed)
        assert all(self.exchange[e.handle.index] != "bad" for e in self.sup.engine.tracker)

    @precondition(lambda self: self.channel_open and not self.closed)
    @rule(ack=st.booleans(), multiple=st.booleans(), data=st.data())
    def confirm(self, ack: bool, multiple: bool, data: st.DataObject) -> None:
        tracker = self.sup.engine.tracker
        tags = [unpack_key(e.key)[1] for e in tracker]
        tag = data.draw(st.sampled_from(tags) if tags else st.integers(0, 3), label="tag")
        generation = tracker.generation - data.draw(st.sampled_from([0, 0, 0, 1]), label="old")
        settled = [e for e in tracker if unpack_key(e.key)[1] <= tag] if multiple else []
        settled = settled or [e for e in tracker if unpack_key(e.key)[1] == tag]
        if generation != tracker.generation:
            settled = []
        resolutions = self.sup.on_confirm(generation, ack, tag, multiple, self.now)
        if ack:
            assert [r for r in resolutions] == settled
            assert all(isinstance(r.outcome, Confirmation) for r in resolutions)
        else:
            assert {r.handle.index for r in resolutions} <= {e.handle.index for e in settled}
            assert all(isinstance(r.outcome, MessageNacked) for r in resolutions)
        assert not any(e in settled for e in tracker)
        self._record(resolutions)

    @precondition(lambda self: self.channel_open and not self.closed)
    @rule(code=st.sampled_from([404, 320]))
    def channel_close(self, code: int) -> None:
        wire = list(self.sup.engine.tracker)
        text = NOT_FOUND_X if code == 404 else FORCED
        resolutions, delay = self.sup.channel_closed(code, text, self.now)
        self.channel_open = False
        if code == 404:
            named = [e for e in wire if e.message.exchange == "X"][:1]
            # a close that names no message in flight blames the one alone on the wire, if so
            culprits = named or (wire if len(wire) == 1 else [])
            assert [r for r in resolutions] == culprits and delay == 0.0
            assert all(isinstance(r.outcome, MessageRejected) for r in resolutions)
        else:
            assert resolutions == [] and delay > 0
        assert len(self.sup.engine.tracker) == 0
        self._record(resolutions)

    @precondition(lambda self: self.connected and not self.channel_open and not self.closed)
    @rule()
    def reopen_channel(self) -> None:
        self.sup.channel_opened()
        self.channel_open = True

    @precondition(lambda self: self.connected and not self.closed)
    @rule()
    def lose_connection(self) -> None:
        resolutions, plan = self.sup.connection_lost(None, self.now, established=True)
        assert resolutions == [] and isinstance(plan, Reconnect)
        assert len(self.sup.engine.tracker) == 0
        self.connected = self.channel_open = False

    @precondition(lambda self: not self.connected and not self.closed)
    @rule()
    def reconnect(self) -> None:
        self.sup.next_attempt()
        self.sup.channel_opened()
        self.connected = self.channel_open = True

    @precondition(lambda self: self.channel_open and not self.closed)
    @rule(blocked=st.booleans())
    def block(self, blocked: bool) -> None:
        if blocked:
            self.sup.blocked("alarm")
            assert not self.sup.writable
        else:
            self.sup.unblocked()
            assert self.sup.writable

    @precondition(lambda self: not self.closed)
    @rule(dt=st.sampled_from([0.25, 0.5, 2.0, 6.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        resolutions = self.sup.tick(self.now)
        for r in resolutions:
            assert isinstance(r.outcome, DeliveryTimeout) and r.deadline <= self.now
        self._record(resolutions)
        due = self.sup.next_wakeup()
        assert due is None or due > self.now or self.sup.engine.has_sendable()

    @invariant()
    def in_flight_matches(self) -> None:
        if not hasattr(self, "sup"):
            return
        in_flight = self.published - len(self.resolved)
        assert len(self.sup.engine) == in_flight == self.window.count
        assert self.sup.engine.stats().in_flight == in_flight
        assert len(self.sup.engine.tracker) <= in_flight

    def teardown(self) -> None:
        if not hasattr(self, "sup"):
            return
        self.sup.begin_close()
        resolutions = self.sup.shutdown()
        assert all(isinstance(r.outcome, PublisherClosed) for r in resolutions)
        self._record(resolutions)
        self.sup.closed()
        assert sorted(self.resolved) == list(range(1, self.published + 1))
        assert len(self.sup.engine) == 0 and self.window.count == 0 and self.window.bytes == 0
        counters = self.sup.engine.counters
        assert counters.published == self.published
        outcomes = Counter(self.resolved.values())
        assert counters.confirmed == outcomes[Confirmation]
        assert counters.rejected == outcomes[MessageRejected]
        assert counters.failed_nacked == outcomes[MessageNacked]
        assert counters.timed_out == outcomes[DeliveryTimeout]
        assert counters.closed == outcomes[PublisherClosed]


SupervisorMachine.TestCase.settings = SETTINGS
test_supervisor_against_model = SupervisorMachine.TestCase
