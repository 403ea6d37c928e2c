"""docs/architecture.md's hop list matches the code: every ``module:Qualified.name`` it names
exists (a renamed function must be renamed in the map a newcomer reads)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
#: a hop as the list writes it: `package.module:Qualified.name`
HOP = re.compile(r"`(reliable_amqp(?:\.\w+)*):(\w+(?:\.\w+)*)`")


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## The hops, per thread")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _hops() -> list[tuple[str, str]]:
    return HOP.findall(_section())


def test_the_hop_list_has_every_thread_and_the_reconnects() -> None:
    headings = re.findall(r"^### (.+)$", _section(), re.MULTILINE)
    assert len(headings) == 8, headings
    assert sum("reconnect" in h for h in headings) == 2
    assert len(_hops()) > 60


@pytest.mark.parametrize("module, name", sorted(set(_hops())))
def test_each_hop_names_a_function_that_exists(module: str, name: str) -> None:
    found: object = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(found, part), f"{module}:{name}: no {part!r} in {found!r}"
        found = getattr(found, part)
    assert callable(found), f"{module}:{name} is not a function"
