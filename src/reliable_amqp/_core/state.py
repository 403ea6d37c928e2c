"""Publisher connection states and the transitions allowed between them, as one table.

Both adapters move through these states only via :meth:`StateMachine.transition`, so "what can
happen next" is read here and nowhere else (the h11 way).
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class State(enum.Enum):
    """Where a publisher's connection is."""

    #: first connection attempt under way
    CONNECTING = "connecting"
    #: channel open in confirm mode: messages are written
    OPEN = "open"
    #: the broker sent ``connection.blocked`` (resource alarm): nothing is written, deadlines run
    BLOCKED = "blocked"
    #: connection or channel lost: reconnecting under the connect retry policy
    RECOVERING = "recovering"
    #: tearing down: settling what is left, closing the connection
    CLOSING = "closing"
    #: finished; every handle has been resolved
    CLOSED = "closed"


#: state -> states it may move to
TRANSITIONS: dict[State, frozenset[State]] = {
    State.CONNECTING: frozenset({State.OPEN, State.RECOVERING, State.CLOSING}),
    State.OPEN: frozenset({State.BLOCKED, State.RECOVERING, State.CLOSING}),
    State.BLOCKED: frozenset({State.OPEN, State.RECOVERING, State.CLOSING}),
    State.RECOVERING: frozenset({State.OPEN, State.CLOSING}),
    State.CLOSING: frozenset({State.CLOSED}),
    State.CLOSED: frozenset(),
}

#: states in which messages may be written to the channel
WRITABLE: frozenset[State] = frozenset({State.OPEN})


class InvalidTransition(RuntimeError):
    """A bug: a publisher tried a transition the table does not allow."""


class StateMachine:
    """The current state, with a listener called on every change (for hooks and stats)."""

    def __init__(self, on_change: Callable[[State, State], None] | None = None) -> None:
        self._state = State.CONNECTING
        self._on_change = on_change

    @property
    def state(self) -> State:
        """The current state."""
        return self._state

    @property
    def writable(self) -> bool:
        """True when messages may be written now."""
        return self._state in WRITABLE

    def transition(self, new: State) -> bool:
        """Move to ``new``; a move to the current state is a no-op and returns False."""
        old = self._state
        if new is old:
            return False
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(f"publisher cannot go from {old.value} to {new.value}")
        self._state = new
        if self._on_change is not None:
            self._on_change(old, new)
        return True
