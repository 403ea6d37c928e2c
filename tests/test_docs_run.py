"""The Python blocks of the docs (``docs/*.md``, ``README.md``) that are complete programs run as
written, against the real broker and databases, the way tests/test_examples.py runs examples/:
a doc that stops running fails CI (issue 48).

Which block is a program is said in the doc itself, by a comment on the line before its fence::

    <!-- runs -->
    <!-- runs queues=orders declare=orders postgresql=postgresql://app@db/shop timeout=90 -->

Every other ``python`` block is a fragment (a call shown in context, names the page defined
above it): fragments are listed by ``test_a_fragment_compiles`` (its ids, with ``-v``), and a
fragment that looks like a whole program (it imports something and uses no name it does not
define) fails ``test_a_block_that_looks_complete_is_marked`` until it is marked ``runs``, or
``<!-- fragment: why -->`` says why it is not run (it serves forever, it needs a remote host).

A marked block runs in a subprocess of its own, in a temporary directory, with a timeout, and
must exit 0 with no traceback on stderr. What the marker's options do:

- ``queues=a,b``: the string literals ``"a"`` and ``'a'`` become a queue name of the test's
  own (several runs share the broker); those queues, and any named after them (a consumer's
  ``a.dead``, ``a.retry.1000ms``), are deleted after the test.
- ``declare=a``: that (renamed) queue is declared, durable, before the block runs: for a block
  that publishes to a queue an earlier block of the page declared.
- ``postgresql=DSN`` / ``mysql=DSN``: the literal ``DSN`` becomes a database of the test's own,
  made empty before the block and dropped after.
- ``timeout=S``: the run's limit (default 60 s).

The broker URL the docs show, ``amqp://guest:guest@127.0.0.1:5672/%2F``, becomes the test
broker's (the same one unless ``AMQP_TEST_*`` say otherwise). Blocks that only include an
example (``--8<-- "examples/..."``) are left to tests/test_examples.py.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import os
import re
import subprocess
import symtable
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.broker import BrokerAdmin
from support.outbox import mysql_database, pg_database

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
MARK = re.compile(r"<!--\s*(runs|fragment)\b:?(.*?)-->")
OPTIONS = {"queues", "declare", "postgresql", "mysql", "timeout"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    #: "runs", "fragment" (marked so), or "" (unmarked: a fragment)
    mark: str = ""
    options: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^(\s*)```python\s*$", lines[i])
            if not fence:
                i += 1
                continue
            indent, start = fence[1], i
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
                i += 1
            code = "\n".join(body) + "\n"
            above = next((s.strip() for s in reversed(lines[:start]) if s.strip()), "")
            marked = MARK.fullmatch(above)
            mark, options = "", {}
            if marked:
                mark = marked[1]
                if mark == "runs":  # a word without "=" is kept, for the test that names it
                    options = dict((*word.split("=", 1), "")[:2] for word in marked[2].split())
            if not code.lstrip().startswith("--8<--"):
                found.append(Block(page, start + 1, code, mark, options))
            i += 1
    return found


BLOCKS = _blocks()
RUNS = [b for b in BLOCKS if b.mark == "runs"]
FRAGMENTS = [b for b in BLOCKS if b.mark != "runs"]


def _undefined(code: str) -> set[str]:
    """Names the code uses that neither it nor the builtins define (any scope)."""
    top = symtable.symtable(code, "<doc>", "exec")
    defined = {
        s.get_name()
        for s in top.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace() or s.is_parameter()
    }
    missing: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            name = symbol.get_name()
            used_from_module = table is top or symbol.is_global()
            if symbol.is_referenced() and used_from_module and name not in defined:
                missing.add(name)
        for child in table.get_children():
            walk(child)

    walk(top)
    return {name for name in missing if not hasattr(builtins, name)}


def _looks_complete(code: str) -> bool:
    try:
        tree = ast.parse(code)
        undefined = _undefined(code)
    except SyntaxError:  # top-level await: a fragment of a coroutine
        return False
    imports = any(isinstance(node, ast.Import | ast.ImportFrom) for node in tree.body)
    return imports and not undefined


def test_the_marker_is_read() -> None:
    readme = [b for b in RUNS if b.page.name == "README.md"]
    assert readme and readme[0].code.startswith("from reliable_amqp import Publisher")
    assert _undefined("import os\nprint(os.sep, x)\ndef f(a):\n    return a + y\n") == {"x", "y"}
    assert _looks_complete("import os\nprint(os.sep)\n")
    assert not _looks_complete("publisher.publish('', 'q', b'')\n")


def test_every_marker_option_is_known() -> None:
    wrong = {
        b.id: sorted(k for k, v in b.options.items() if k not in OPTIONS or not v) for b in RUNS
    }
    assert not {k: v for k, v in wrong.items() if v}, f"unknown or empty options: {wrong}"
    for block in RUNS:
        declared = set(filter(None, block.options.get("declare", "").split(",")))
        assert declared <= set(block.options.get("queues", "").split(",")), block.id


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_a_fragment_compiles(block: Block) -> None:
    """A fragment is not run, but it is Python (top-level ``await`` allowed)."""
    compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_a_block_that_looks_complete_is_marked(block: Block) -> None:
    if block.mark == "fragment":
        return
    assert not _looks_complete(block.code), (
        f"{block.id} imports what it needs and uses no undefined name: mark it "
        "'<!-- runs -->' (then it is run) or '<!-- fragment: why -->'"
    )


@contextlib.contextmanager
def _databases(block: Block) -> Iterator[dict[str, str]]:
    """The literal DSNs of the block -> databases of the test's own."""
    with contextlib.ExitStack() as stack:
        dsns = {}
        if "postgresql" in block.options:
            dsns[block.options["postgresql"]] = stack.enter_context(pg_database())
        if "mysql" in block.options:
            dsns[block.options["mysql"]] = stack.enter_context(mysql_database())
        yield dsns


def _delete_queues(broker: BrokerAdmin, names: list[str], consumer: bool) -> None:
    """Delete ``names``, and for a block with a consumer the queues it named after them
    (``NAME.dead``, ``NAME.retry.*``: listed by rabbitmqctl, 1 s, so only then)."""
    doomed = set(names)
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "name", "--no-table-headers"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    ) if consumer else None  # fmt: skip
    if listed is not None and listed.returncode == 0:  # else the names themselves
        doomed |= {
            q.strip() for q in listed.stdout.splitlines() if q.strip().startswith(tuple(names))
        }
    for queue in sorted(doomed):
        broker._ch().queue_delete(queue)


@pytest.mark.broker
@pytest.mark.parametrize("block", RUNS, ids=[b.id for b in RUNS])
def test_a_marked_block_runs(
    block: Block, amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    code = block.code.replace(DOCS_URL, amqp_url)
    token = uuid.uuid4().hex[:10]
    queues = {q: f"ra-docs-{token}-{q}" for q in block.options.get("queues", "").split(",") if q}
    for name, own in queues.items():
        assert f'"{name}"' in code or f"'{name}'" in code, f"{block.id}: no queue {name!r}"
        code = code.replace(f'"{name}"', repr(own)).replace(f"'{name}'", repr(own))
    for name in block.options.get("declare", "").split(","):
        if name:
            broker._ch().queue_declare(queues[name], durable=True)
    try:
        with _databases(block) as dsns:
            for literal, dsn in dsns.items():
                assert literal in code, f"{block.id}: no {literal!r} to replace"
                code = code.replace(literal, dsn)
            (tmp_path / "block.py").write_text(code, encoding="utf-8")
            result = subprocess.run(
                [sys.executable, "block.py"],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                env={**os.environ, "AMQP_URL": amqp_url, "PYSPARK_PYTHON": sys.executable},
                timeout=float(block.options.get("timeout", 60)),
                check=False,
            )
    finally:
        if queues:
            _delete_queues(broker, list(queues.values()), consumer="Consumer(" in code)
    assert result.returncode == 0 and "Traceback" not in result.stderr, (
        f"{block.id} exited {result.returncode}\n--- the block as run\n{code}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
