"""Unit tests of ``_core/state.py``: the transitions table and the StateMachine."""

from __future__ import annotations

import itertools
from typing import cast

import pytest

from reliable_amqp._core.state import (
    TRANSITIONS,
    WRITABLE,
    InvalidTransition,
    State,
    StateMachine,
)

# --- state table ----------------------------------------------------------------------------------


def test_state_machine_follows_the_table_and_reports_changes() -> None:
    changes: list[tuple[State, State]] = []
    machine = StateMachine(on_change=lambda old, new: changes.append((old, new)))
    path = [
        State.OPEN,
        State.BLOCKED,
        State.OPEN,
        State.RECOVERING,
        State.OPEN,
        State.CLOSING,
        State.CLOSED,
    ]
    assert machine.state is State.CONNECTING and not machine.writable
    for new in path:
        assert machine.transition(new) is True
        # cast: mypy keeps machine.state narrowed to CONNECTING across transition()
        assert cast(State, machine.state) is new
        assert machine.writable is (new is State.OPEN)
    assert changes == list(zip([State.CONNECTING, *path[:-1]], path, strict=True))


def test_transition_to_the_current_state_is_a_no_op() -> None:
    changes: list[tuple[State, State]] = []
    machine = StateMachine(on_change=lambda old, new: changes.append((old, new)))
    assert machine.transition(State.CONNECTING) is False
    assert changes == []


_INVALID = [
    (old, new)
    for old, new in itertools.product(State, State)
    if old is not new and new not in TRANSITIONS[old]
]


@pytest.mark.parametrize("old, new", _INVALID, ids=[f"{a.value}->{b.value}" for a, b in _INVALID])
def test_invalid_transitions_are_rejected(old: State, new: State) -> None:
    changes: list[tuple[State, State]] = []
    machine = StateMachine(on_change=lambda a, b: changes.append((a, b)))
    machine._state = old  # put the machine in ``old`` without going through the listener
    with pytest.raises(InvalidTransition, match=f"{old.value} to {new.value}"):
        machine.transition(new)
    assert machine.state is old and changes == []


def test_state_table_shape() -> None:
    assert set(TRANSITIONS) == set(State)
    assert frozenset({State.OPEN}) == WRITABLE
    assert TRANSITIONS[State.CLOSED] == frozenset()
    assert {(State.OPEN, State.CONNECTING), (State.CLOSED, State.OPEN)} <= set(_INVALID)
    # every state can reach CLOSED, and every state is reachable from CONNECTING
    for start in State:
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert State.CLOSED in seen
        if start is State.CONNECTING:
            assert seen == set(State)


# --- the table itself, and the machine's edges ----------------------------------------------------


def test_state_values_are_the_names_hooks_and_stats_show() -> None:
    assert [s.value for s in State] == [
        "connecting",
        "open",
        "blocked",
        "recovering",
        "closing",
        "closed",
    ]


def test_transitions_table_is_exactly_the_documented_one() -> None:
    assert {
        State.CONNECTING: {State.OPEN, State.RECOVERING, State.CLOSING},
        State.OPEN: {State.BLOCKED, State.RECOVERING, State.CLOSING},
        State.BLOCKED: {State.OPEN, State.RECOVERING, State.CLOSING},
        State.RECOVERING: {State.OPEN, State.CLOSING},
        State.CLOSING: {State.CLOSED},
        State.CLOSED: set(),
    } == TRANSITIONS
    assert all(type(targets) is frozenset for targets in TRANSITIONS.values())
    assert all(state not in TRANSITIONS[state] for state in State)  # no self-loops
    # every state but CLOSED can start closing, and only CLOSING can finish
    assert [s for s in State if State.CLOSING in TRANSITIONS[s]] == [
        State.CONNECTING,
        State.OPEN,
        State.BLOCKED,
        State.RECOVERING,
    ]
    assert [s for s in State if State.CLOSED in TRANSITIONS[s]] == [State.CLOSING]


def test_a_machine_without_a_listener_still_moves() -> None:
    machine = StateMachine()
    assert machine.transition(State.RECOVERING) is True
    assert machine.transition(State.RECOVERING) is False
    assert machine.transition(State.OPEN) is True
    assert machine.state is State.OPEN and machine.writable


def test_invalid_transition_is_a_runtime_error_naming_both_states() -> None:
    machine = StateMachine()
    with pytest.raises(InvalidTransition) as info:
        machine.transition(State.CLOSED)
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == "publisher cannot go from connecting to closed"
    assert machine.state is State.CONNECTING


def test_closed_is_final_but_staying_closed_is_a_no_op() -> None:
    machine = StateMachine()
    machine.transition(State.CLOSING)
    machine.transition(State.CLOSED)
    assert machine.transition(State.CLOSED) is False
    for new in set(State) - {State.CLOSED}:
        with pytest.raises(InvalidTransition):
            machine.transition(new)
    assert machine.state is State.CLOSED and not machine.writable


def test_only_open_is_writable() -> None:
    for state in State:
        machine = StateMachine()
        machine._state = state
        assert machine.writable is (state is State.OPEN)
