"""What kind of callable a user passed: a plain function, a coroutine function, a generator.

A coroutine function handed to code that calls it plainly returns a coroutine that is never
awaited: its work never runs, and whatever follows (an ack) treats it as done. A plain function
handed to code that awaits its result runs its side effect, then fails on the ``await``. Both
are refused before anything happens. ``functools.partial`` objects, bound methods and
instances whose ``__call__`` is one of these are seen through.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Literal

from reliable_amqp._core.errors import ConfigurationError

Kind = Literal["function", "coroutine function", "generator function", "async generator function"]


class WrongHandlerKind(ConfigurationError, TypeError):
    """A handler of the wrong kind for its consumer (an ``async def`` for :class:`Consumer`,
    a plain function for :class:`AsyncConsumer`, a generator for either)."""


def kind_of(fn: Any) -> Kind:
    """The kind of ``fn`` (a callable), seen through partials, methods and ``__call__``."""
    target = fn
    for _ in range(32):  # partials of partials, objects calling objects: bounded
        if _marked_coroutine(target):
            return "coroutine function"
        if isinstance(target, functools.partial):
            target = target.func
            continue
        if inspect.ismethod(target):
            target = target.__func__
            continue
        if inspect.isfunction(target) or inspect.isbuiltin(target) or inspect.isclass(target):
            break
        call = inspect.getattr_static(type(target), "__call__", None)
        if call is None or call is target:
            break
        target = call
    if inspect.iscoroutinefunction(target):
        return "coroutine function"
    if inspect.isasyncgenfunction(target):
        return "async generator function"
    if inspect.isgeneratorfunction(target):
        return "generator function"
    return "function"


def _marked_coroutine(fn: Any) -> bool:
    # asyncio's marker on objects that are awaitable-returning without being ``async def``
    # (unittest.mock.AsyncMock sets it); inspect.iscoroutinefunction sees 3.12's own marker
    # (compared by identity: a MagicMock answers every attribute). Nothing carries the marker
    # unless asyncio was imported, so it is looked up, not imported.
    coroutines = sys.modules.get("asyncio.coroutines")
    marker = getattr(coroutines, "_is_coroutine", None)
    if marker is None:
        return False
    try:
        return getattr(fn, "_is_coroutine", None) is marker
    except Exception:  # a hostile __getattr__
        return False


def check_handler(handler: object, *, want_async: bool, where: str) -> None:
    """Refuse ``handler`` unless it is callable and of the kind ``where`` calls.

    ``where`` names the consumer ("Consumer.run"); the error says which one takes the handler.
    """
    if not callable(handler):
        raise WrongHandlerKind(f"{where} takes a callable handler(delivery), got {handler!r}")
    kind = kind_of(handler)
    name = getattr(handler, "__qualname__", None) or repr(handler)
    if kind in ("generator function", "async generator function"):
        raise WrongHandlerKind(
            f"{where}: handler {name} is a {kind}: calling it only creates a generator and "
            "runs none of its body; write a plain function"
            + (" (or async def for AsyncConsumer)" if not want_async else " or an async def")
        )
    if want_async and kind != "coroutine function":
        raise WrongHandlerKind(
            f"{where}: handler {name} is a plain function; AsyncConsumer awaits its handler, "
            "so write it as 'async def' (a plain function's side effect would run and its "
            "result could not be awaited), or run it with Consumer"
        )
    if not want_async and kind == "coroutine function":
        raise WrongHandlerKind(
            f"{where}: handler {name} is an 'async def' function; Consumer calls its handler "
            "plainly and the coroutine would never run: use AsyncConsumer "
            "(await consumer.run(handler)), or make the handler a plain function"
        )


def returned_awaitable(result: object, where: str) -> WrongHandlerKind:
    """The error for a plain handler that returned an awaitable (a lambda around an async
    function, say): the awaitable is closed so it warns nothing; its work never ran."""
    close = getattr(result, "close", None)
    if inspect.iscoroutine(result) and close is not None:
        close()
    return WrongHandlerKind(
        f"{where}: the handler returned {type(result).__name__} {result!r}, an awaitable that "
        "Consumer cannot run: its work did not happen and the message goes back to the queue; "
        "use AsyncConsumer for async handlers"
    )
