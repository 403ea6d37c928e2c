"""No import circle under ``src/``: each module's imports, wherever they are written (at the
top, under ``TYPE_CHECKING``, inside a function), form a graph without cycles.

A circle that type-only or late imports hide still ties the modules together: neither can be
read, tested or changed without the other. Parent packages imported on the way (``a.b`` imports
``a`` first) are not edges: only what a module names.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "reliable_amqp"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
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
