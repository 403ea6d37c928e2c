"""What an adapter does with a publish, for tests of the core: the message's entry made by the
one factory production uses (:func:`~reliable_amqp._core.entry.fresh_entry`), its handle and
issue number set, taken by the engine."""

from __future__ import annotations

from typing import Any, TypeVar

from reliable_amqp._core.engine import PublishEngine
from reliable_amqp._core.entry import Entry, new_entry
from reliable_amqp._core.errors import PublishError
from reliable_amqp._core.message import Confirmation, OutgoingMessage

H = TypeVar("H")


def entry_for(
    message: OutgoingMessage,
    handle: H,
    deadline: float = 0.0,
    size: int | None = None,
    *,
    index: int = 0,
    outcome: Confirmation | PublishError | None = None,
) -> Entry[H]:
    """``message``'s entry as ``publish()`` makes it (:data:`new_entry`), with ``handle`` and
    what the test sets beyond: ``deadline``, ``size`` (default: the body's), ``index`` and,
    for a resolved one, its ``outcome``."""
    entry: Entry[Any] = new_entry(
        message.exchange,
        message.routing_key,
        message.body,
        message.base,
        message.mandatory,
        message.message_id,
    )
    # built from it already: the errors the entry resolves to carry this very message (the
    # models compare by identity), as Entry.message would build it from the parts
    entry._message = message
    entry.handle = handle
    entry.deadline = deadline
    if size is not None:
        entry.size = size
    entry.index = index
    entry.outcome = outcome
    return entry


def accept(
    engine: PublishEngine[Entry[H]],
    message: OutgoingMessage,
    handle: H,
    now: float,
    index: int | None = None,
) -> Entry[H]:
    """``message`` taken by ``engine`` as a publisher takes it; its entry. ``index`` (its issue
    number in the window) defaults to ``handle.index``, else 0."""
    entry = entry_for(
        message, handle, index=getattr(handle, "index", 0) if index is None else index
    )
    engine.accept((entry,), now)
    return entry
