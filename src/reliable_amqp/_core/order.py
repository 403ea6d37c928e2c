"""Per-key order in a consumer: which key a delivery has, and when a key must wait.

No I/O. A consumer with ``key=`` handles a key's messages one at a time, in the order the queue
delivered them (the async consumer's workers take a key only when no other worker holds it).
A retry would break that order: the failing message goes to a delay queue and comes back behind
its key's later messages. So a key whose message is being retried is *fenced*:

- the failing message (the key's *head*) goes to its delay queue as any retry does, stamped
  with a token (:data:`HEAD_HEADER`);
- every later message of the key is *parked*: republished, confirmed, to the key's *follow
  queue* (the first delay queue), numbered in :data:`PARKED_HEADER` (0, 1, 2... per fence),
  then acked. While the head is not settled, each parked message comes back after the follow
  queue's delay and is parked again (the queue is FIFO: they keep their cyclic order);
- when the head succeeds (or is dead-lettered, unless ``after_dead_letter="hold"``), the
  parked messages are handled by number: one that comes back before its turn is parked again
  (at most one pass puts them back in line), and messages arriving meanwhile are parked behind
  them; the fence lifts when none is parked.

Nothing of a fenced key waits in memory or in the prefetch window: its messages wait in the
broker, in the follow queue, and the consumer keeps one small record per fenced key.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from reliable_amqp._core.callables import kind_of
from reliable_amqp._core.errors import ConfigurationError

#: on a parked copy: the key it waits for (its value is the key)
PARKED_HEADER = "x-consume-parked"
#: on a fenced key's head's retry copy: the fence's token, to know it when it comes back
HEAD_HEADER = "x-consume-order-head"

AfterDeadLetter = Literal["continue", "hold"]
KeyReader = Callable[[Any], "str | None"]


def key_reader(option: object) -> KeyReader | None:
    """The function reading a delivery's key from the ``key`` option (None: no key).

    ``"routing_key"``, ``"header:<name>"`` (the header's value as text; absent: no key), or a
    plain callable ``delivery -> str | None``.
    """
    if option is None:
        return None
    if isinstance(option, str):
        if option == "routing_key":
            return _routing_key
        if option.startswith("header:") and len(option) > len("header:"):
            return _header(option[len("header:") :])
        raise ConfigurationError(
            f"key must be 'routing_key', 'header:<name>' or a callable (delivery) -> str | "
            f"None, got {option!r}"
        )
    if callable(option):
        kind = kind_of(option)
        if kind != "function":
            raise ConfigurationError(
                f"key must be a plain callable (delivery) -> str | None, got a {kind} "
                f"{option!r}: the key is read before the handler runs, without awaiting"
            )
        return _checked(option)
    raise ConfigurationError(
        f"key must be 'routing_key', 'header:<name>' or a callable, got {option!r}"
    )


def _routing_key(delivery: Any) -> str | None:
    key: str = delivery.routing_key
    return key


def _header(name: str) -> KeyReader:
    def read(delivery: Any) -> str | None:
        headers = delivery.headers
        value = headers.get(name) if headers else None
        if value is None:
            return None
        if isinstance(value, (bytes, bytearray)):
            return bytes(value).decode("utf-8", "surrogateescape")
        return value if isinstance(value, str) else str(value)

    return read


def _checked(fn: Callable[[Any], object]) -> KeyReader:
    def read(delivery: Any) -> str | None:
        key = fn(delivery)
        if key is None or isinstance(key, str):
            return key
        raise TypeError(f"the key callable returned {key!r}, not a str or None")

    return read


@dataclass(slots=True)
class Fence:
    """One fenced key: its head's token (None once settled), where its later messages wait,
    and their order: parked messages are numbered from 0 (``next_seq`` is the next number), and
    ``expected`` is the number to handle next once the head is settled."""

    token: str | None
    follow_queue: str
    next_seq: int = 0
    expected: int = 0
    #: numbers whose first park failed: their message came back to the queue and is parked
    #: again under a new number, so these never return
    lost: set[int] = field(default_factory=set)
    #: ``after_dead_letter="hold"``: the head was dead-lettered; the key waits for it (its
    #: message_id) to come back from the dead letters and succeed
    dead_id: str | None = None

    @property
    def waiting(self) -> int:
        """How many of the key's messages are parked."""
        return self.next_seq - self.expected - len(self.lost)

    def skip_lost(self) -> None:
        while self.expected in self.lost:
            self.lost.discard(self.expected)
            self.expected += 1


def parked_seq(headers: Mapping[str, Any] | None) -> int | None:
    """The park number a returning parked copy carries (None: not a parked copy)."""
    value = headers.get(PARKED_HEADER) if headers else None
    return value if type(value) is int else None


class Fences:
    """The fenced keys of one consumer (see the module's docstring)."""

    def __init__(self, after_dead_letter: AfterDeadLetter = "continue") -> None:
        if after_dead_letter not in ("continue", "hold"):
            raise ConfigurationError(
                f"after_dead_letter must be 'continue' or 'hold', got {after_dead_letter!r}"
            )
        self.hold = after_dead_letter == "hold"
        self._fences: dict[str, Fence] = {}
        self._tokens = (f"{os.getpid():x}.{n:x}" for n in itertools.count(1))

    def __len__(self) -> int:
        return len(self._fences)

    def follow_queues(self) -> set[str]:
        """Where the fenced keys' later messages wait (one queue per partition that has any)."""
        return {fence.follow_queue for fence in list(self._fences.values())}

    def fenced(self, key: str) -> Fence | None:
        """The key's fence (None: the key flows)."""
        return self._fences.get(key)

    def admit(
        self, key: str, headers: Mapping[str, Any] | None, message_id: str | None
    ) -> tuple[str, int] | None:
        """None: handle this delivery now; else ``(queue, number)``: park it in ``queue`` under
        that number (behind its key's other parked messages)."""
        fence = self._fences.get(key)
        if fence is None:
            return None
        seq = parked_seq(headers)
        if seq is None:
            if fence.token is not None and headers and headers.get(HEAD_HEADER) == fence.token:
                return None  # the head, back from its delay queue
            if fence.dead_id is not None and message_id == fence.dead_id:
                return None  # a held key's dead head, put back by an operator
            seq = fence.next_seq  # a new message of the key: behind the parked ones
            fence.next_seq += 1
            return fence.follow_queue, seq
        if fence.token is None:
            fence.skip_lost()
            if seq <= fence.expected:
                return None  # its turn (or a copy of one handled already: the inbox's to drop)
        # not its turn yet: parked again. The follow queue is FIFO, so the parked messages keep
        # their cyclic order; once the head is settled, at most one pass puts them back in line
        return fence.follow_queue, seq

    def retrying(self, key: str, first_queue: str, seq: int | None) -> str:
        """A message of ``key`` failed and is retried: it is the key's head now (``seq``: its
        park number, if it was a parked one). Returns the token its retry copy carries."""
        fence = self._fences.get(key)
        if fence is None:
            fence = self._fences[key] = Fence(None, first_queue)
        elif seq is not None:
            self._handled(fence, seq)
        token = fence.token or next(self._tokens)
        fence.token = token
        fence.dead_id = None
        return token

    def settled(self, key: str, seq: int | None) -> None:
        """A message of ``key`` succeeded (or was dead-lettered, the key going on)."""
        fence = self._fences.get(key)
        if fence is None:
            return
        if seq is not None:
            self._handled(fence, seq)
        else:
            fence.token = None  # the head (nothing else of a fenced key is handled unparked)
            fence.dead_id = None
        self._maybe_lift(key, fence)

    def dead(self, key: str, follow_queue: str, seq: int | None, dead_id: str) -> None:
        """A message of ``key`` was dead-lettered (``dead_id``: its message_id, '' if none).
        With ``after_dead_letter="hold"`` the key then waits for that message to come back
        (an operator's ``dead-letters --requeue``) and succeed; else it goes on."""
        if not self.hold or not dead_id:
            self.settled(key, seq)
            return
        fence = self._fences.get(key)
        if fence is None:
            fence = self._fences[key] = Fence(None, follow_queue)
        elif seq is not None:
            self._handled(fence, seq)
        fence.token = fence.token or next(self._tokens)
        fence.dead_id = dead_id

    def unpark(self, key: str, seq: int) -> None:
        """The first park of number ``seq`` failed (its message goes back to the queue, to be
        parked again under a new number)."""
        fence = self._fences.get(key)
        if fence is not None and fence.expected <= seq < fence.next_seq:
            fence.lost.add(seq)
            fence.skip_lost()
            self._maybe_lift(key, fence)

    @staticmethod
    def _handled(fence: Fence, seq: int) -> None:
        if seq == fence.expected:
            fence.expected += 1
            fence.skip_lost()

    def _maybe_lift(self, key: str, fence: Fence) -> None:
        if fence.token is None and fence.expected >= fence.next_seq:
            del self._fences[key]
