"""AsyncPublishFuture: the asyncio future ``AsyncPublisher.publish()`` returns, which is also
the engine's entry for its message.

The sync publisher's future is its entry (``_sync/_future.PublishFuture``): one object per
message in flight for the garbage collector, whose full passes over the messages in flight were
the largest cost left per message. The async one is the same here: an ``asyncio.Future`` (the
C one: awaiting it costs what awaiting any future costs) whose extra slots are the
:class:`~reliable_amqp._core.entry.Entry` fields, not an ``Entry`` with a future as its
``handle``. Python cannot make a class with both as bases (two C layouts: "multiple bases have
instance lay-out conflict"), so the class has the entry's slots and methods under the same
names and is registered as a virtual subclass of ``Entry``; ``tests/async/test_async_future.py``
checks it keeps every field and method of ``Entry`` and that :func:`future_entry` sets what
``fresh_entry`` sets.

Used where no spool is (the spool's feed counts who holds a message's future: there the
entry keeps a future of its own as its ``handle``).
"""

from __future__ import annotations

import asyncio
from types import FunctionType
from typing import TYPE_CHECKING, Any

from reliable_amqp._core.entry import Entry, Stage
from reliable_amqp._core.message import Confirmation, MessageProperties

__all__ = ["AsyncPublishFuture", "future_entry", "future_of"]


def _entry_namespace() -> dict[str, Any]:
    """``Entry``'s methods and properties (its slots are declared anew), to put on the future:
    plain functions and properties read ``self``'s fields by name, which the future has."""
    namespace: dict[str, Any] = {}
    for klass in reversed(Entry.__mro__):
        if klass.__module__ in ("builtins", "typing"):
            continue
        for name, value in vars(klass).items():
            # functions and properties only: slots are declared anew, and the rest
            # (_abc_impl, _is_protocol) is the class machinery of typing's Protocol
            if not name.startswith("__") and isinstance(value, (FunctionType, property)):
                namespace[name] = value
    return namespace


if TYPE_CHECKING:
    # (typed as an entry whose handle is a future, as the publisher's entries are; at run
    # time its handle is None: it is its own future, see future_of)
    class AsyncPublishFuture(  # type: ignore[misc]  # (disjoint bases: the point above)
        asyncio.Future[Confirmation], Entry[asyncio.Future[Confirmation]]
    ):
        """The caller's future of a message, which is also its engine entry."""

else:
    # Named "Future", as asyncio's: its repr and asyncio's "Future exception was never
    # retrieved" read as they did when the caller's future was a plain one (log filters match
    # them)
    AsyncPublishFuture = type(
        "Future",
        (asyncio.Future,),
        {
            "__slots__": Entry.__slots__,
            "__module__": __name__,
            "__qualname__": "AsyncPublishFuture",
            "__doc__": "The caller's future of a message, which is also its engine entry "
            "(an asyncio.Future; its other attributes are the publisher's bookkeeping).",
            **_entry_namespace(),
        },
    )
    Entry.register(AsyncPublishFuture)


_WAITING = Stage.WAITING


def future_entry(  # noqa: PLR0917
    loop: asyncio.AbstractEventLoop,
    exchange: str,
    routing_key: str,
    body: bytes,
    base: MessageProperties,
    mandatory: bool,
    message_id: str,
) -> AsyncPublishFuture:
    """``fresh_entry``'s twin for :class:`AsyncPublishFuture` (a future of ``loop``): the same
    fields, set the same way (``tests/async/test_async_future.py`` compares them)."""
    entry = AsyncPublishFuture(loop=loop)
    entry.exchange = exchange
    entry.routing_key = routing_key
    entry.body = body
    entry.base = base
    entry.mandatory = mandatory
    entry.message_id = message_id
    entry._message = None
    entry.handle = None  # type: ignore[assignment]  # its own future: see future_of
    entry.size = len(body)
    entry.index = 0
    entry.attempts = 0
    entry.key = -1
    entry.returned = None
    entry.isolated = False
    entry.nacks = 0
    entry.state = _WAITING
    entry.raw_outcome = None
    return entry


def future_of(entry: Entry[asyncio.Future[Confirmation]]) -> asyncio.Future[Confirmation]:
    """The caller's future of ``entry``: its ``handle`` (a plain :class:`Entry`: a spooled
    message's, or one made before the publisher knew its loop), else the entry itself."""
    handle: asyncio.Future[Confirmation] | None = entry.handle
    if handle is None:
        assert isinstance(entry, AsyncPublishFuture)
        return entry
    return handle
