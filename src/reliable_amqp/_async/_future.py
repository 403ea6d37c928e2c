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

A confirmed message's future is resolved with :data:`~reliable_amqp._core.entry.CONFIRMED`,
not a :class:`Confirmation`: ``result()``, ``await`` and the repr build the confirmation the
first time they are asked (``Entry.outcome``, cached in the entry), as the sync publisher's
future does, so a future nobody reads costs no object at its confirm (and nothing for the
garbage collector: docs/benchmarks.md). ``await`` therefore goes through a Python
``__await__`` (asyncio's own, pure-Python one, reading :meth:`result`): the C future's would
hand out what was stored. Everything in asyncio that reads a future's outcome (tasks awaiting
it, ``gather``, ``shield``, ``wait_for``, ``run_until_complete``, chained futures) calls
``result()`` on a future that is not exactly an ``asyncio.Future``.

Used where no spool is (the spool's feed counts who holds a message's future: there the
entry keeps a future of its own as its ``handle``).
"""

from __future__ import annotations

import asyncio
import reprlib
from asyncio.base_futures import _future_repr_info
from collections.abc import Callable, Generator
from types import FunctionType
from typing import TYPE_CHECKING, Any

from reliable_amqp._core.entry import CONFIRMED, Entry, Stage
from reliable_amqp._core.message import Confirmation, MessageProperties

__all__ = ["AsyncPublishFuture", "MakeEntry", "entry_maker", "future_entry", "future_of"]


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


_future_result = asyncio.Future.result


def _result(self: Any) -> Any:
    """``asyncio.Future.result()``; a confirmed message's :class:`Confirmation` is built here,
    the first time anything asks for it (its future was resolved with :data:`CONFIRMED`)."""
    result = _future_result(self)
    if result is CONFIRMED:
        return self.outcome  # Entry.outcome: built once, then the same object every time
    return result


def _await(self: Any) -> Generator[Any, None, Any]:
    """``asyncio.Future.__await__`` (as asyncio's pure-Python future has it) through
    :func:`_result`: the C future's own would hand out :data:`CONFIRMED` itself."""
    if not self.done():
        self._asyncio_future_blocking = True
        yield self  # the task awaits it, and wakes up when it is done
    if not self.done():
        raise RuntimeError("await wasn't used with future")
    return self.result()


def _repr(self: Any) -> str:
    """asyncio's repr of a future (``<Future finished result=...>``), with the confirmation
    in it, not :data:`CONFIRMED`."""
    info = " ".join(_future_repr_info(self))
    if "result=CONFIRMED" in info:
        info = info.replace("result=CONFIRMED", f"result={reprlib.repr(self.result())}")
    return f"<{type(self).__name__} {info}>"


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
            "result": _result,
            "__await__": _await,
            "__iter__": _await,
            "__repr__": _repr,
        },
    )
    Entry.register(AsyncPublishFuture)


_WAITING = Stage.WAITING


#: what :func:`entry_maker` returns: ``MessageBuilder``'s ``new`` for a loop's futures
MakeEntry = Callable[[str, str, bytes, MessageProperties, bool, str], AsyncPublishFuture]


def entry_maker(loop: asyncio.AbstractEventLoop) -> MakeEntry:
    """:func:`future_entry` for the futures of ``loop``, as the one function the builder calls
    per message (``partial(future_entry, loop)`` costs each publish a C call more)."""

    def make(  # noqa: PLR0917
        exchange: str,
        routing_key: str,
        body: bytes,
        base: MessageProperties,
        mandatory: bool,
        message_id: str,
    ) -> AsyncPublishFuture:
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

    return make


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
    fields, set the same way (``tests/async/test_async_future.py`` compares them). What
    :func:`entry_maker` makes."""
    return entry_maker(loop)(exchange, routing_key, body, base, mandatory, message_id)


def future_of(entry: Entry[asyncio.Future[Confirmation]]) -> asyncio.Future[Confirmation]:
    """The caller's future of ``entry``: its ``handle`` (a plain :class:`Entry`: a spooled
    message's, or one made before the publisher knew its loop), else the entry itself."""
    handle: asyncio.Future[Confirmation] | None = entry.handle
    if handle is None:
        assert isinstance(entry, AsyncPublishFuture)
        return entry
    return handle
