"""No import circle under ``src/``, ``benchmarks/`` or ``tests/``: each module's imports,
wherever they are written (at the top, under ``TYPE_CHECKING``, inside a function), form a graph
without cycles. ``benchmarks/`` and ``tests/`` are directories on ``sys.path`` (their modules
import each other as ``outbox_harness``, ``support.broker``): a module is named from there.

A circle that type-only or late imports hide still ties the modules together: neither can be
read, tested or changed without the other. Parent packages imported on the way (``a.b`` imports
``a`` first) are not edges: only what a module names.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = "reliable_amqp"


def _modules(top: Path = SRC / PACKAGE, base: Path = SRC) -> dict[str, Path]:
    """The modules under ``top``, named as imported with ``base`` on ``sys.path``."""
    found = {}
    for path in sorted(top.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of this package that ``name`` imports (by name or relatively)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    return {t for t in targets if t in modules and t != name}


def _graph(top: Path = SRC / PACKAGE, base: Path = SRC) -> dict[str, set[str]]:
    modules = _modules(top, base)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), shortest found."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_a_cycle(graph, group) for group in groups]


def _a_cycle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = group[0]
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & set(group)):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    return group


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = _graph()
    # at the top, by name
    assert "reliable_amqp._core.engine" in graph["reliable_amqp._core.supervisor"]
    # late, inside a function (AsyncPublisher is loaded on first use)
    assert "reliable_amqp._async" in graph["reliable_amqp"]
    # under TYPE_CHECKING
    assert "reliable_amqp._async.publisher" in graph["reliable_amqp"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_circle_under_src() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


#: Circles known and left, each with why: no new one may join them.
KNOWN_CIRCLES = {
    # the fake broker's connection names FakeBroker's type only (under TYPE_CHECKING), for the
    # 22 attributes of the shared state it reads; the peer creates the connections
    ("fake.connection", "fake.peer", "fake.connection"),
}


def test_no_import_circle_in_the_benchmarks_or_the_tests() -> None:
    """benchmarks/outbox_children.py and outbox_harness.py imported each other (issue 47)."""
    benchmarks = _graph(ROOT / "benchmarks", ROOT / "benchmarks")
    assert "outbox_harness" in benchmarks["outbox_children"]  # the graph sees these imports
    assert "support.broker" in _graph(ROOT / "tests", ROOT / "tests")["test_examples"]
    for where in ("benchmarks", "tests"):
        cycles = [c for c in _cycles(_graph(ROOT / where, ROOT / where))
                  if tuple(c) not in KNOWN_CIRCLES]  # fmt: skip
        assert not cycles, f"import circles in {where}/: " + "; ".join(
            " -> ".join(c) for c in cycles
        )
