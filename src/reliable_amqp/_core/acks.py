"""Which deliveries of a consumer channel may be acknowledged, and with which frames (no I/O).

The publisher keeps its unconfirmed messages in order and settles them as confirms arrive; a
consumer mirrors that. Its channel delivers tags in increasing order; handlers finish them in
any order (``concurrency > 1``, a retry waiting for its republish to be confirmed). One
``basic.ack`` with ``multiple`` may cover a run of tags only when *every* tag up to it is
finished: :class:`AckBook` keeps the tags in delivery order and acks the finished prefix with one
frame. Finished tags behind an unfinished one are acked one by one, and only when they would
otherwise hold up the prefetch (a batch's worth of them) or on a flush, never earlier: a
``multiple`` ack must never cover a message whose handler is still running.

Tags belong to one channel: a book is made per channel *generation*; settlements addressed to an
older generation are refused (the broker already requeued those deliveries when the channel
died, and an ack of an old tag on a new channel would ack the wrong message or close it).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable
from typing import Protocol

__all__ = ["ACK", "REQUEUE", "AckBook", "AckFrame", "ack_batch", "encode_ack_frames"]

#: settlement kinds
ACK = 1
REQUEUE = 2

_PENDING = 0
_ACK_DUE = 1
_REQUEUE_DUE = 2
_SENT = 3

#: ("ack" | "nack", delivery tag, multiple); a "nack" always requeues
AckFrame = tuple[str, int, bool]

# basic.ack (60, 80) and basic.nack (60, 120) method frames: type 1, channel, size 13, class,
# method, delivery tag, bits (multiple 1, requeue 2), frame-end
_method_frame = struct.Struct(">BHIHHQBB").pack


def encode_ack_frames(channel: int, frames: Iterable[AckFrame]) -> bytes:
    """The wire bytes of ``frames`` on ``channel`` (a nack always requeues), as one buffer."""
    return b"".join(
        _method_frame(1, channel, 13, 60, 80, tag, 1 if multiple else 0, 0xCE)
        if method == "ack"
        else _method_frame(1, channel, 13, 60, 120, tag, 3 if multiple else 2, 0xCE)
        for method, tag, multiple in frames
    )


def ack_batch(prefetch: int) -> int:
    """How many finished deliveries make an ack frame worth sending (and wake a consumer's I/O
    thread) while the handler side is busy: a tenth of the prefetch. An idle handler side
    sends what is finished at once, whatever the count."""
    return max(1, prefetch // 10)


class _Tagged(Protocol):
    delivery_tag: int


class AckBook:
    """The delivered, finished and acknowledged tags of one consumer channel generation."""

    __slots__ = ("_due", "_order", "_state", "batch", "generation")

    def __init__(self, generation: int, batch: int = 1) -> None:
        self.generation = generation
        #: how many finished tags may wait for a combined ack (e.g. a tenth of the prefetch)
        self.batch = max(1, batch)
        self._order: deque[int] = deque()
        self._state: dict[int, int] = {}
        self._due = 0  # finished tags not yet covered by a frame

    def __len__(self) -> int:
        """Tags delivered and not yet acked or requeued."""
        return len(self._state)

    @property
    def held(self) -> int:
        """Tags the broker still counts as unacked (delivered, no frame sent for them yet)."""
        return sum(1 for mark in self._state.values() if mark != _SENT)

    @property
    def due(self) -> int:
        """Finished tags waiting for their frame."""
        return self._due

    def delivered(self, tag: int) -> None:
        """Record a delivery (tags arrive in increasing order on a channel)."""
        if self._order and tag <= self._order[-1]:
            raise ValueError(f"delivery tag {tag} is not above the last one ({self._order[-1]})")
        self._order.append(tag)
        self._state[tag] = _PENDING

    def delivered_all(self, deliveries: Iterable[_Tagged]) -> None:
        """Record a batch of deliveries (each with its ``delivery_tag``), in delivery order."""
        order = self._order
        state = self._state
        last = order[-1] if order else 0
        for d in deliveries:
            tag = d.delivery_tag
            if tag <= last:
                raise ValueError(f"delivery tag {tag} is not above the last one ({last})")
            order.append(tag)
            state[tag] = _PENDING
            last = tag

    def settle(self, generation: int, tag: int, kind: int = ACK) -> bool:
        """A handler finished ``tag``: ``ACK`` it or ``REQUEUE`` it.

        False (and nothing recorded) when the tag is of another generation, unknown, or already
        settled: the caller counts it as left to the broker's redelivery, never sends a frame.
        """
        if generation != self.generation or self._state.get(tag) != _PENDING:
            return False
        self._state[tag] = _ACK_DUE if kind == ACK else _REQUEUE_DUE
        self._due += 1
        return True

    def settle_all(self, settlements: deque[tuple[int, int, int]]) -> int:
        """:meth:`settle` each ``(generation, tag, kind)`` taken from the left of
        ``settlements`` until it is empty (another thread may append meanwhile); returns how
        many were refused. One call a batch, not one a message."""
        state = self._state
        generation = self.generation
        refused = 0
        due = 0
        try:
            while settlements:
                gen, tag, kind = settlements.popleft()
                if gen != generation or state.get(tag) != _PENDING:
                    refused += 1
                    continue
                state[tag] = _ACK_DUE if kind == ACK else _REQUEUE_DUE
                due += 1
        finally:
            self._due += due
        return refused

    def ready(self) -> bool:
        """Whether :meth:`take` without ``force`` would return frames now."""
        return self._due >= self.batch

    def take(self, force: bool = False) -> list[AckFrame]:
        """The frames to send now (and forget what they cover).

        Without ``force`` nothing is sent until a batch of finished tags waits; with it,
        everything finished goes out (idle, stopping).
        """
        if not self._due or (not force and self._due < self.batch):
            return []
        frames: list[AckFrame] = []
        order = self._order
        state = self._state
        # The finished prefix: one multiple ack up to its last acked tag. Requeues in it go out
        # singly first (a multiple ack would otherwise ack them).
        top = 0
        while order:
            tag = order[0]
            mark = state[tag]
            if mark == _PENDING:
                break
            order.popleft()
            del state[tag]
            if mark == _ACK_DUE:
                top = tag
                self._due -= 1
            elif mark == _REQUEUE_DUE:
                if top:
                    frames.append(("ack", top, True))
                    top = 0
                frames.append(("nack", tag, False))
                self._due -= 1
        if top:
            frames.append(("ack", top, True))
        # Finished tags behind an unfinished one: singly, once a batch of them waits.
        if self._due and (force or self._due >= self.batch):
            for tag in order:
                mark = state[tag]
                if mark == _ACK_DUE:
                    frames.append(("ack", tag, False))
                elif mark == _REQUEUE_DUE:
                    frames.append(("nack", tag, False))
                else:
                    continue
                state[tag] = _SENT
                self._due -= 1
        return frames

    def requeue_rest(self) -> list[AckFrame]:
        """Stopping: the frames that ack what is finished, then give every other tag back.

        Finished tags are acked first; the rest (delivered, never finished) are requeued with
        one multiple nack up to the last delivered tag. The book is empty afterwards.
        """
        frames = self.take(force=True)
        pending = [tag for tag, mark in self._state.items() if mark == _PENDING]
        if pending:
            frames.append(("nack", max(pending), True))
        self._order.clear()
        self._state.clear()
        self._due = 0
        return frames
