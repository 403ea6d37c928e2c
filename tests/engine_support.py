"""What an adapter does with a publish, for tests of the core: the message's entry, its handle
and issue number set, taken by the engine."""

from __future__ import annotations

from typing import TypeVar

from reliable_amqp._core.engine import PublishEngine
from reliable_amqp._core.message import OutgoingMessage
from reliable_amqp._core.tracker import Entry

H = TypeVar("H")


def accept(
    engine: PublishEngine[Entry[H]],
    message: OutgoingMessage,
    handle: H,
    now: float,
    index: int | None = None,
) -> Entry[H]:
    """``message`` taken by ``engine`` as a publisher takes it; its entry. ``index`` (its issue
    number in the window) defaults to ``handle.index``, else 0."""
    entry: Entry[H] = Entry(message, handle, 0.0, len(message.body))
    entry.index = getattr(handle, "index", 0) if index is None else index
    engine.accept((entry,), now)
    return entry
