"""Admission: whether a publish goes in now, and what that takes, written once for both publishers.

A message is admitted in one step (:meth:`Admission.admit`): the publisher must still accept
messages (else :class:`PublisherClosed`, with its fatal error as cause when it gave up), the
in-flight window must have room (else :data:`NO_ROOM`), then the message gets its issue number
in the window, its span starts (telemetry, when on: once nothing can refuse it), and it is
handed over to the writer; the step returns the wake-up to make. ``publish_many()``'s loop is
:class:`AdmitMany`, which each publisher steps through.

The two publishers differ only in how they wait for room (a thread on a waiter, off the
handoff's lock; a task on a future, in turn with the other tasks) and in the hand-over they
give (:data:`HandOver`): the sync one appends to the outbox the I/O thread reads, under the
handoff's lock (every step here runs under it), and wakes that thread once the lock is
released; the async one gives the entries to the engine and wakes its writer task.

Not locked: the sync publisher holds its handoff's lock around every call, the async one runs
on one event loop.

Interrupted: a ``KeyboardInterrupt`` (Ctrl-C in the main thread) can be raised wherever the
interpreter takes signals: since Python 3.11, at the entry of a Python function and after a C
function returns. One raised between counting a message in the window and the hand-over would
keep its room for good (``flush()`` would never return): the steps here give it back
(:meth:`Admission.interrupted`) unless the hand-over already took the message, which
:attr:`Admission.took` tells (the sync publisher's outbox, the async one's engine). An
``AsyncPublisher`` meets one too: ``asyncio.run`` turns the first Ctrl-C into a cancellation at
an ``await``, but the second, and every one under Python 3.10 or a bare ``run_until_complete``,
is raised wherever the loop's thread is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence, Sized
from typing import Any, Generic, Literal, Protocol, TypeVar

from reliable_amqp._core.entry import Entry
from reliable_amqp._core.errors import PublisherClosed, PublishTimeout, ReliableAmqpError
from reliable_amqp._core.window import Window

E = TypeVar("E", bound="Entry[Any]")
E_contra = TypeVar("E_contra", bound="Entry[Any]", contravariant=True)

#: a wake-up of the publisher's writer, to call once the publisher's lock (if any) is released
Wake = Callable[[], None]
#: how a publisher gives an admitted entry (issue number set, span started) to its writer;
#: returns the wake-up to make, or None when one is on its way already
HandOver = Callable[[E], Wake | None]
#: the same for a run of admitted entries, in order (publish_many)
HandOverRun = Callable[[Sequence[E]], Wake | None]


class NoRoom(enum.Enum):
    """What :meth:`Admission.admit` answers when the window has no room for the message."""

    NO_ROOM = "no room"


#: the window is full (or others wait for room first): wait for room, the publisher's way,
#: and admit again
NO_ROOM = NoRoom.NO_ROOM


class SpanStart(Protocol[E_contra]):
    """What admission needs of telemetry (``_otel.Telemetry``)."""

    def on_publish(self, entry: E_contra, index: int) -> None:
        """The message with issue number ``index`` was admitted: its span starts."""


class Admission(Generic[E]):
    """One publisher's admission (see the module docstring): whether it still accepts
    messages, its window, its telemetry and its hand-over."""

    __slots__ = (
        "accepting",
        "fatal",
        "hand_over",
        "hand_over_run",
        "telemetry",
        "took",
        "waiting",
        "window",
    )

    def __init__(
        self,
        window: Window,
        hand_over: HandOver[E],
        hand_over_run: HandOverRun[E],
        waiting: Sized = (),
        took: Callable[[E], bool] | None = None,
    ) -> None:
        self.window = window
        # two hand-overs: a tuple of one, extended into a deque, costs a publish 2.5% more
        self.hand_over = hand_over
        self.hand_over_run = hand_over_run
        #: the publisher's queue of publishes waiting for room, first come first served: while
        #: it is not empty, a publish queues behind them even if it would fit (the async
        #: publisher's; the sync publisher's threads have none)
        self.waiting = waiting
        #: False once the publisher closes (close(), aclose(), a fork's child)
        self.accepting = True
        #: why the publisher gave up for good (wrong credentials, connect policy spent)
        self.fatal: ReliableAmqpError | None = None
        #: OpenTelemetry, set at connect (None: off)
        self.telemetry: SpanStart[E] | None = None
        #: whether the hand-over holds an entry already (the sync publisher's outbox, the async
        #: one's engine; None: an interrupted admission is not undone, see the module docstring)
        self.took = took

    def check(self, entry: E) -> None:
        """Raise :class:`PublisherClosed` for ``entry`` when the publisher no longer accepts
        messages (its fatal error as cause when it gave up)."""
        fatal = self.fatal
        if fatal is not None:
            raise PublisherClosed(entry.message, 0, str(fatal)) from fatal
        if not self.accepting:
            raise PublisherClosed.refused("publish()", entry.message)

    def admit(self, entry: E) -> Wake | Literal[NoRoom.NO_ROOM] | None:
        """Admit ``entry`` if there is room: the wake-up to make (None: none needed), or
        :data:`NO_ROOM`. Raises :class:`PublisherClosed` when the publisher no longer accepts
        messages. (A publisher with a queue of publishes :attr:`waiting` sends a publish to the
        back of it before it asks: one check less on the sync publisher's hot path.)"""
        if self.fatal is not None or not self.accepting:
            self.check(entry)
        index = self.window.try_issue(entry.size)
        if not index:
            return NO_ROOM
        try:  # (free of cost on Python 3.11+ until something is raised)
            entry.index = index
            telemetry = self.telemetry
            if telemetry is not None:  # the span starts once nothing can refuse it
                telemetry.on_publish(entry, index)
            return self.hand_over(entry)
        except BaseException:
            self.interrupted((entry,))
            raise

    def interrupted(self, entries: Sequence[E]) -> bool:
        """An interrupt ended an admission after ``entries`` (the latest issued, in order) were
        counted in the window: give their room back, unless the hand-over took them (see the
        module docstring). True when it was given back."""
        took = self.took
        if took is None or took(entries[-1]):
            return False
        window = self.window
        for entry in reversed(entries):
            window.unissue(entry.size)
            entry.index = 0
        return True

    def admit_many(self, entries: Sequence[E]) -> AdmitMany[E]:
        """``publish_many()``'s loop over ``entries`` (:class:`AdmitMany`)."""
        return AdmitMany(self, entries)


class AdmitMany(Generic[E]):
    """``publish_many()``'s loop: admit entries in order, as many at a time as the window
    takes; the publisher calls :meth:`step` until :attr:`finished`, and waits for room its own
    way where a step says so.

    A step that finds the window full (or others waiting first) returns the entry that waits
    for room; the publisher waits until it fits and its turn came, then steps again, or tells
    :meth:`give_up` the :class:`PublishTimeout` its wait ended with: raised again when nothing
    was admitted yet, else the loop is over and :meth:`unadmitted` fail with it (the publisher
    sets their futures, off its lock).
    """

    __slots__ = ("_turn", "admission", "done", "entries", "timeout")

    def __init__(self, admission: Admission[E], entries: Sequence[E]) -> None:
        self.admission = admission
        self.entries = entries
        #: how many were admitted
        self.done = 0
        #: what the rest fail with, once a wait for room ended so
        self.timeout: PublishTimeout | None = None
        self._turn = False  # the next entry waited for room and its turn came

    @property
    def finished(self) -> bool:
        """True once every entry was admitted, or a wait for room ended the loop."""
        return self.done >= len(self.entries) or self.timeout is not None

    def step(self) -> E | Wake | None:
        """Admit the next run: the wake-up to make (None: none needed), or the entry that waits
        for room. Raises :class:`PublisherClosed` when the publisher no longer accepts
        messages."""
        admission = self.admission
        window = admission.window
        entries = self.entries
        done = self.done
        entry = entries[done]
        admission.check(entry)
        if (admission.waiting and not self._turn) or not window.fits(entry.size):
            self._turn = True  # when it steps again, it has waited its turn
            return entry
        self._turn = False
        taken = entries[done : done + window.issue_run(entries, done)]
        try:
            telemetry = admission.telemetry
            if telemetry is not None:  # the spans start once nothing can refuse them
                for each in taken:
                    telemetry.on_publish(each, each.index)
            self.done = done + len(taken)
            return admission.hand_over_run(taken)
        except BaseException:
            if admission.interrupted(taken):
                self.done = done  # none of the run went out
            raise

    def give_up(self, timeout: PublishTimeout) -> None:
        """The wait for room ended with ``timeout``: raised again when nothing was admitted
        yet, else the loop is over and the rest fail with it."""
        if not self.done:
            raise timeout
        self.timeout = timeout

    def unadmitted(self) -> Sequence[E]:
        """What a wait for room left out (they fail with :attr:`timeout`)."""
        return self.entries[self.done :] if self.timeout is not None else ()
