"""Unit tests of ``_core/admission.py``: whether a publish goes in now, and publish_many's loop,
as both publishers drive them (the publishers' own waits are tested against the broker and the
fake peer)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import pytest

from reliable_amqp._core.admission import NO_ROOM, Admission
from reliable_amqp._core.builder import build_message
from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import PublisherClosed, PublishTimeout, RecoveryFailed
from reliable_amqp._core.window import Window
from support.engine import entry_for

Item = Entry[None]


class Writer:
    """A hand-over that records what it was given and answers with a wake-up once."""

    def __init__(self) -> None:
        self.runs: list[list[Item]] = []
        self.woken = 0
        self.pending = False

    def hand_over(self, entry: Item) -> Any:
        return self.hand_over_run([entry])

    def hand_over_run(self, entries: Sequence[Item]) -> Any:
        self.runs.append(list(entries))
        if self.pending:
            return None
        self.pending = True
        return self.wake

    def wake(self) -> None:
        self.woken += 1


class Spans:
    def __init__(self) -> None:
        self.started: list[int] = []

    def on_publish(self, entry: Item, index: int) -> None:
        assert entry.index == index
        self.started.append(index)


def _entries(*sizes: int) -> list[Item]:
    return [entry_for(build_message("x", "rk", bytes(size)), None) for size in sizes]


def _admission(
    count: int = 2, size: int = 100, waiting: Any = ()
) -> tuple[Admission[Item], Writer]:
    writer = Writer()
    return Admission(Window(count, size), writer.hand_over, writer.hand_over_run, waiting), writer


def test_a_publish_with_room_gets_its_index_its_span_and_is_handed_over() -> None:
    admission, writer = _admission()
    admission.telemetry = spans = Spans()
    first, second = _entries(1, 1)
    assert admission.admit(first) == writer.wake
    assert admission.admit(second) is None  # a wake-up is on its way already
    assert (first.index, second.index) == (1, 2)
    assert spans.started == [1, 2] and writer.runs == [[first], [second]]


def test_a_full_window_answers_no_room_and_takes_nothing() -> None:
    admission, writer = _admission(count=1)
    first, second = _entries(1, 1)
    admission.admit(first)
    assert admission.admit(second) is NO_ROOM
    assert second.index == 0 and writer.runs == [[first]] and admission.window.count == 1


def test_a_closed_or_failed_publisher_refuses_and_takes_nothing() -> None:
    admission, writer = _admission()
    [entry] = _entries(1)
    admission.accepting = False
    with pytest.raises(PublisherClosed, match="closed"):
        admission.admit(entry)
    admission.accepting = True
    admission.fatal = fatal = RecoveryFailed("gave up")
    with pytest.raises(PublisherClosed) as caught:
        admission.admit(entry)
    assert caught.value.__cause__ is fatal and caught.value.message.message_id == entry.message_id
    assert writer.runs == [] and admission.window.count == 0


def test_publish_many_admits_runs_as_the_window_takes_them() -> None:
    admission, writer = _admission(count=3, size=10**6)
    admission.telemetry = spans = Spans()
    entries = _entries(1, 1, 1, 1, 1)
    many = admission.admit_many(entries)
    assert many.step() == writer.wake and many.done == 3
    assert many.step() is entries[3]  # the window is full: this one waits for room
    admission.window.release(entries[:2])
    assert many.step() is None and many.finished  # (a wake-up is on its way already)
    assert writer.runs == [entries[:3], entries[3:]] and spans.started == [1, 2, 3, 4, 5]
    assert list(many.unadmitted()) == []


def test_publish_many_that_times_out_fails_the_rest_or_raises_when_none_went_in() -> None:
    admission, _ = _admission(count=2)
    entries = _entries(1, 1, 1)
    many = admission.admit_many(entries)
    many.step()
    assert many.step() is entries[2]
    timeout = PublishTimeout("full")
    many.give_up(timeout)
    assert many.finished and many.timeout is timeout and list(many.unadmitted()) == entries[2:]
    stuck = admission.admit_many(_entries(1))
    assert stuck.step() is stuck.entries[0]
    with pytest.raises(PublishTimeout):
        stuck.give_up(timeout)


def test_publish_many_queues_behind_waiting_publishes_once() -> None:
    queue: deque[object] = deque([object()])
    admission, writer = _admission(waiting=queue)
    entries = _entries(1)
    many = admission.admit_many(entries)
    assert many.step() is entries[0]  # behind the one waiting
    assert many.step() == writer.wake and many.finished  # its turn came
