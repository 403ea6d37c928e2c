"""ConfirmTracker against a naive model: random interleavings of publish, ack, nack (single and
``multiple``, current and stale tags), return, discard and channel loss.

The model is a plain dict of the attempts on the wire in the current generation; every answer of
the tracker is compared with what the model says, and every attempt must leave the tracker exactly
once (acked, nacked, returned, handed back by ``new_generation`` or discarded).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reliable_amqp._core.entry import Entry
from reliable_amqp._core.message import MessageProperties, OutgoingMessage
from reliable_amqp._core.tracker import (
    ConfirmTracker,
    attempt_tag,
    pack_key,
    parse_attempt_tag,
    unpack_key,
)
from support.engine import entry_for


def _entry(n: int) -> Entry[int]:
    message = OutgoingMessage("ex", "rk", b"x" * n, MessageProperties(message_id=f"m{n}"))
    return entry_for(message, n, deadline=100.0, size=n)


ACKED, NACKED, RETURNED = "acked", "nacked", "returned"


def settled(
    tracker: ConfirmTracker[Entry[int]], generation: int, tag: int, multiple: bool, *, ack: bool
) -> list[tuple[Entry[int], str]]:
    """What an ack (or nack) settles, and how: an acked entry with ``returned`` set was returned."""
    return [
        (e, (RETURNED if e.returned else ACKED) if ack else NACKED)
        for e in tracker.pop_settled(generation, tag, multiple)
    ]


@dataclass
class _Wire:
    """The model's view of one attempt on the wire."""

    entry: Entry[int]
    attempt: int
    returned: bool = False


@dataclass
class _Model:
    generation: int = 0
    seq: int = 0
    #: seq -> attempt on the wire, current generation only
    wire: dict[int, _Wire] = field(default_factory=dict)


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tracker: ConfirmTracker[Entry[int]] = ConfirmTracker()
        self.model = _Model()
        self.entries: list[Entry[int]] = []
        #: (entry handle, attempt number) -> how often the tracker let go of that attempt
        self.released: Counter[tuple[int, int]] = Counter()
        self.started: set[tuple[int, int]] = set()
        #: attempt tags of attempts no longer on the wire (returns for them must be ignored)
        self.old_tags: list[str] = []

    # --- helpers -----------------------------------------------------------------------------

    def _off_wire(self) -> list[Entry[int]]:
        on = {id(w.entry) for w in self.model.wire.values()}
        return [e for e in self.entries if id(e) not in on]

    def _release(self, wire: _Wire) -> None:
        key = (wire.entry.handle, wire.attempt)
        self.released[key] += 1
        assert self.released[key] == 1, f"attempt {key} left the tracker twice"
        self.old_tags.append(attempt_tag(pack_key(self.model.generation, self._seq_of(wire))))

    def _seq_of(self, wire: _Wire) -> int:
        return next(s for s, w in self.model.wire.items() if w is wire)

    def _expect_settle(
        self, generation: int, tag: int, multiple: bool, ack: bool
    ) -> list[tuple[Entry[int], str]]:
        model = self.model
        if generation != model.generation or tag <= 0:
            return []
        seqs = (
            sorted(s for s in model.wire if s <= tag)
            if multiple
            else ([tag] if tag in model.wire else [])
        )
        expected: list[tuple[Entry[int], str]] = []
        for s in seqs:
            wire = model.wire[s]
            outcome = (RETURNED if wire.returned else ACKED) if ack else NACKED
            self._release(wire)
            del model.wire[s]
            expected.append((wire.entry, outcome))
        return expected

    def _check_settled(
        self, got: list[tuple[Entry[int], str]], expected: list[tuple[Entry[int], str]]
    ) -> None:
        assert [(e.handle, o) for e, o in got] == [(e.handle, o) for e, o in expected]
        for (g, _), (e, _) in zip(got, expected, strict=True):
            assert g is e
            assert g.key == -1

    def _track(self, entry: Entry[int]) -> None:
        before = entry.attempts
        tag = self.tracker.track(entry)
        self.model.seq += 1
        assert tag == self.model.seq
        assert entry.key == pack_key(self.model.generation, tag)
        assert entry.attempts == before + 1
        assert entry.returned is None
        self.model.wire[tag] = _Wire(entry, entry.attempts)
        self.started.add((entry.handle, entry.attempts))

    def _draw_target(self, data: st.DataObject) -> tuple[int, int]:
        """A (generation, tag): mostly current, some stale, some beyond the last tag."""
        model = self.model
        generation = data.draw(
            st.sampled_from([model.generation] * 4 + [model.generation - 1, model.generation + 1])
        )
        tag = data.draw(st.integers(min_value=0, max_value=model.seq + 2))
        return generation, tag

    # --- rules -------------------------------------------------------------------------------

    @rule()
    def publish_new(self) -> None:
        entry = _entry(len(self.entries) + 1)
        self.entries.append(entry)
        self._track(entry)

    @rule(data=st.data(), new=st.integers(min_value=0, max_value=5))
    def publish_batch(self, data: st.DataObject, new: int) -> None:
        """A writer's batch (track_all): new entries and republished ones, in wire order."""
        batch = []
        for _ in range(new):
            entry = _entry(len(self.entries) + 1)
            self.entries.append(entry)
            batch.append(entry)
        off = [entry for entry in self._off_wire() if entry not in batch]
        if off:
            batch += data.draw(st.lists(st.sampled_from(off), unique_by=id, max_size=3))
        batch = data.draw(st.permutations(batch))
        before = [entry.attempts for entry in batch]
        self.tracker.track_all(batch)
        for entry, attempts in zip(batch, before, strict=True):
            self.model.seq += 1
            assert entry.key == pack_key(self.model.generation, self.model.seq)
            assert entry.attempts == attempts + 1
            assert entry.returned is None
            self.model.wire[self.model.seq] = _Wire(entry, entry.attempts)
            self.started.add((entry.handle, entry.attempts))

    @precondition(lambda self: any(True for _ in self._off_wire()))
    @rule(data=st.data())
    def publish_again(self, data: st.DataObject) -> None:
        """Republish an entry that was nacked, handed back, discarded or settled."""
        self._track(data.draw(st.sampled_from(self._off_wire())))

    @rule(data=st.data(), multiple=st.booleans())
    def ack(self, data: st.DataObject, multiple: bool) -> None:
        generation, tag = self._draw_target(data)
        expected = self._expect_settle(generation, tag, multiple, ack=True)
        self._check_settled(settled(self.tracker, generation, tag, multiple, ack=True), expected)

    @rule(data=st.data(), multiple=st.booleans())
    def nack(self, data: st.DataObject, multiple: bool) -> None:
        generation, tag = self._draw_target(data)
        expected = self._expect_settle(generation, tag, multiple, ack=False)
        self._check_settled(settled(self.tracker, generation, tag, multiple, ack=False), expected)

    @precondition(lambda self: len(self.model.wire) >= 2)
    @rule(data=st.data())
    def lavinmq_nacks_then_acks_multiple(self, data: st.DataObject) -> None:
        """Nacks come singly, then one ack-multiple covers the nacked tags too."""
        seqs = sorted(self.model.wire)
        nacked = data.draw(st.lists(st.sampled_from(seqs), min_size=1, unique=True))
        generation = self.model.generation
        nacked_handles = set()
        for seq in nacked:
            expected = self._expect_settle(generation, seq, False, ack=False)
            got = settled(self.tracker, generation, seq, False, ack=False)
            self._check_settled(got, expected)
            nacked_handles |= {e.handle for e, _ in got}
        top = data.draw(st.integers(min_value=max(nacked), max_value=seqs[-1]))
        expected = self._expect_settle(generation, top, True, ack=True)
        got = settled(self.tracker, generation, top, True, ack=True)
        self._check_settled(got, expected)
        assert len(nacked_handles) == len(nacked)
        assert not {e.handle for e, _ in got} & nacked_handles

    @precondition(lambda self: bool(self.model.wire))
    @rule(data=st.data(), as_bytes=st.booleans())
    def basic_return(self, data: st.DataObject, as_bytes: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model.wire)))
        wire = self.model.wire[seq]
        tag = attempt_tag(wire.entry.key)
        assert tag == f"{self.model.generation}.{seq}"
        value: object = tag.encode() if as_bytes else tag
        got = self.tracker.on_return(value, 312, "NO_ROUTE")
        assert got is wire.entry
        assert got.returned == (312, "NO_ROUTE")
        wire.returned = True

    @precondition(lambda self: bool(self.old_tags))
    @rule(data=st.data())
    def stale_return(self, data: st.DataObject) -> None:
        """A return naming an attempt that already left the wire changes nothing."""
        tag = data.draw(st.sampled_from(self.old_tags))
        assert self.tracker.on_return(tag, 312, "NO_ROUTE") is None

    @rule(value=st.sampled_from([None, 17, "", "abc", "1", "1.", ".1", "-1.2", b"\xff.1"]))
    def foreign_return(self, value: object) -> None:
        assert self.tracker.on_return(value, 312, "NO_ROUTE") is None

    @precondition(lambda self: bool(self.entries))
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.entries))
        wire = next((w for w in self.model.wire.values() if w.entry is entry), None)
        got = self.tracker.discard(entry)
        assert got is (wire is not None)
        if wire is not None:
            self._release(wire)
            del self.model.wire[self._seq_of(wire)]
            assert entry.key == -1

    @precondition(lambda self: bool(self.entries))
    @rule(data=st.data())
    def untrack(self, data: st.DataObject) -> None:
        """Take back a publish that never reached the wire: only the latest one can be."""
        model = self.model
        latest = model.wire.get(model.seq)
        pick_latest = latest is not None and data.draw(st.booleans(), label="latest")
        entry = (
            latest.entry
            if latest is not None and pick_latest
            else data.draw(st.sampled_from(self.entries), label="entry")
        )
        attempts = entry.attempts
        took_back = latest is not None and latest.entry is entry
        assert self.tracker.untrack(entry) is took_back
        if took_back:
            assert latest is not None
            self.started.discard((entry.handle, latest.attempt))
            del model.wire[model.seq]
            model.seq -= 1
            assert entry.key == -1
            assert entry.attempts == attempts - 1
        else:
            assert entry.attempts == attempts

    @rule()
    def new_generation(self) -> None:
        model = self.model
        expected = [model.wire[s] for s in sorted(model.wire)]
        for wire in expected:
            self._release(wire)
        got = self.tracker.new_generation()
        assert [e.handle for e in got] == [w.entry.handle for w in expected]
        assert all(e is w.entry for e, w in zip(got, expected, strict=True))
        assert all(e.key == -1 for e in got)
        model.wire.clear()
        model.generation += 1
        model.seq = 0
        assert self.tracker.generation == model.generation

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def same_entries_in_publish_order(self) -> None:
        model = self.model
        assert len(self.tracker) == len(model.wire)
        assert [e.handle for e in self.tracker] == [
            model.wire[s].entry.handle for s in sorted(model.wire)
        ]
        for seq, wire in model.wire.items():
            assert wire.entry.key == pack_key(model.generation, seq)
            assert unpack_key(wire.entry.key) == (model.generation, seq)
            assert (wire.entry.returned is not None) is wire.returned

    def teardown(self) -> None:
        # Whatever is still on the wire is handed back by a channel loss: then every attempt
        # ever started has left the tracker exactly once.
        self.new_generation()
        assert len(self.tracker) == 0
        assert set(self.released) == self.started
        assert all(count == 1 for count in self.released.values())


TrackerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_tracker_against_model = TrackerMachine.TestCase


@pytest.mark.parametrize("run_max", [1, 2, 3])
def test_tracker_against_model_with_short_runs(
    run_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tracker keeps publishes in runs of RUN_MAX (256): with runs of 1-3 publishes, the
    # machine's 60 steps cross run boundaries all the time (splits, whole runs, empty runs).
    from hypothesis.stateful import run_state_machine_as_test

    from reliable_amqp._core import tracker as tracker_module

    monkeypatch.setattr(tracker_module, "RUN_MAX", run_max)
    run_state_machine_as_test(
        TrackerMachine,
        settings=settings(max_examples=100, stateful_step_count=60, deadline=None),
    )


# --- a few fixed scenarios, to read as examples ---------------------------------------------------


def test_lavinmq_ack_multiple_skips_tags_nacked_before() -> None:
    tracker: ConfirmTracker[Entry[int]] = ConfirmTracker()
    entries = [_entry(n) for n in range(1, 6)]
    for e in entries:
        tracker.track(e)
    assert tracker.pop_settled(0, 2, False) == [entries[1]]  # nacked
    assert tracker.pop_settled(0, 4, False) == [entries[3]]  # nacked
    assert [e.handle for e in tracker.pop_settled(0, 5, True)] == [1, 3, 5]  # acked
    assert len(tracker) == 0
    assert tracker.pop_settled(0, 5, True) == []


def test_return_then_ack_settles_as_returned_and_retrack_clears_it() -> None:
    tracker: ConfirmTracker[Entry[int]] = ConfirmTracker()
    entry = _entry(1)
    tracker.track(entry)
    assert tracker.on_return(attempt_tag(entry.key).encode(), 312, "NO_ROUTE") is entry
    assert settled(tracker, 0, 1, False, ack=True) == [(entry, RETURNED)]
    tracker.track(entry)
    assert entry.returned is None
    assert settled(tracker, 0, 2, False, ack=True) == [(entry, ACKED)]


def test_frames_of_an_old_generation_are_ignored() -> None:
    tracker: ConfirmTracker[Entry[int]] = ConfirmTracker()
    first, second = _entry(1), _entry(2)
    tracker.track(first)
    old_tag = attempt_tag(first.key)
    assert tracker.new_generation() == [first]
    tracker.track(second)
    tracker.track(first)
    assert tracker.pop_settled(0, 1, True) == []
    assert tracker.pop_settled(0, 2, False) == []
    assert tracker.on_return(old_tag, 312, "NO_ROUTE") is None
    assert [e.handle for e in tracker] == [2, 1]
    assert [e.handle for e in tracker.pop_settled(1, 2, True)] == [2, 1]


@pytest.mark.parametrize("generation, seq", [(0, 1), (3, 7), (2**20, 2**40 - 1)])
def test_attempt_tag_round_trips(generation: int, seq: int) -> None:
    key = pack_key(generation, seq)
    assert unpack_key(key) == (generation, seq)
    assert parse_attempt_tag(attempt_tag(key)) == key
    assert parse_attempt_tag(attempt_tag(key).encode()) == key
