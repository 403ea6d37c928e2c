"""``MODULE:HANDLER`` for ``reliable-amqp worker``: the handler imported, its kind checked.

The module is imported with the current directory first on ``sys.path`` (as ``celery`` and
``faststream run`` do). A handler whose kind does not match ``--async`` is refused before
anything is consumed, with the library's :class:`~reliable_amqp.WrongHandlerKind` worded with
the flags: the kinds are the library's own (:func:`reliable_amqp._core.callables.kind_of`, which
sees through ``functools.partial``, bound methods and callable objects).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from reliable_amqp._core.callables import WrongHandlerKind, kind_of
from reliable_amqp._core.errors import a_type
from reliable_amqp.cli._parse import UsageError


def load_handler(target: str) -> Callable[..., Any]:
    """``MODULE:HANDLER`` imported (``HANDLER`` may be dotted: ``module:App.handle``); a
    :class:`UsageError` that says what is wrong otherwise."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"expected MODULE:HANDLER (e.g. myapp.orders:handle), got {target!r}")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        found: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UsageError(
                f"cannot import {module_name!r}: no module named {missing!r} "
                f"(looked in {here} and the Python path)"
            ) from None
        traceback.print_exc()
        raise UsageError(f"importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # the module's own error: its traceback helps more than a line
        traceback.print_exc()
        raise UsageError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not callable(found):
        raise UsageError(f"{target} is {a_type(found)}, not a function or other callable")
    return found  # type: ignore[no-any-return]


def check_kind(target: str, handler: object, is_async: bool) -> None:
    """Refuse a handler whose kind does not match ``--async`` (the library's
    :class:`~reliable_amqp.WrongHandlerKind`, worded with the flags)."""
    kind = kind_of(handler)
    if kind in ("generator function", "async generator function"):
        raise WrongHandlerKind(
            f"{target} is {'an' if kind[0] == 'a' else 'a'} {kind}: calling it runs none of "
            "its body; a handler returns (a plain function, or with --async a coroutine "
            "function), it does not yield"
        )
    if kind == "coroutine function" and not is_async:
        raise WrongHandlerKind(
            f"{target} is a coroutine function (async def): run it with --async (without it, "
            "each call would return an un-awaited coroutine and its message be acked unhandled)"
        )
    if kind != "coroutine function" and is_async:
        raise WrongHandlerKind(
            f"{target} is a plain function, not a coroutine function (async def): run it "
            "without --async"
        )
