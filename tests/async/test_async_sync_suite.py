"""The sync Publisher's behaviour suite (tests/test_publisher.py), run against AsyncPublisher.

Every test function of that module runs here with its module-level ``Publisher`` replaced by
:class:`BlockingAsyncPublisher` (the sync API over an AsyncPublisher), with the same fixtures
and the same parameters. This is the "one suite, both publishers" of the async issue, without
touching the sync suite: folding it into a parametrized ``publisher_class`` fixture there makes
this module redundant (docs/async.md, "Testing").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aio_blocking import BlockingAsyncPublisher

import test_publisher as sync_suite

pytestmark = pytest.mark.broker


def _cases() -> Iterator[Any]:
    """(test name, parameters) for every case of the sync suite, parametrized ones expanded."""
    for name, function in sorted(vars(sync_suite).items()):
        if not name.startswith("test_") or not callable(function):
            continue
        marks = [m for m in getattr(function, "pytestmark", []) if m.name != "parametrize"]
        parametrize = [m for m in getattr(function, "pytestmark", []) if m.name == "parametrize"]
        if not parametrize:
            yield pytest.param(name, {}, id=name, marks=marks)
            continue
        (mark,) = parametrize  # the sync suite stacks at most one parametrize per test
        argnames = mark.args[0]
        names = [a.strip() for a in argnames.split(",")] if isinstance(argnames, str) else argnames
        for i, value in enumerate(mark.args[1]):
            values = value if len(names) > 1 else (value,)
            yield pytest.param(
                name, dict(zip(names, values, strict=True)), id=f"{name}[{i}]", marks=marks
            )


@pytest.mark.parametrize(("case", "params"), list(_cases()))
def test_sync_case_on_async_publisher(
    case: str,
    params: dict[str, Any],
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    function: Callable[..., None] = getattr(sync_suite, case)
    monkeypatch.setattr(sync_suite, "Publisher", BlockingAsyncPublisher)
    arguments = {
        name: params[name] if name in params else request.getfixturevalue(name)
        for name in inspect.signature(function).parameters
    }
    function(**arguments)
