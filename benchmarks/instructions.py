"""Instructions per confirmed message, counted by valgrind: a figure that machine noise leaves be.

    bash scripts/dev.sh run python benchmarks/instructions.py                   # publishing rows
    bash scripts/dev.sh run python benchmarks/instructions.py --only many,async-many
    git worktree add /tmp/before <commit> && \\
    bash scripts/dev.sh run python benchmarks/instructions.py --compare /tmp/before/src

Each row runs its publishing loop twice under ``valgrind --tool=callgrind`` against the local
broker ($AMQP_URL), with ``--counts`` messages (persistent, ``--size`` bytes, a fresh durable
queue), and reports (instructions of the larger run - those of the smaller) / (the difference
in messages): start-up, imports and connecting cancel out. Every thread of the process is
counted, the I/O thread included. The figure repeats to about 1.5% from run to run whatever
else the machine does, where CPU time swings by 15%; it moves with how the broker batches its
acks, so compare trees in one run (``--compare SRC`` measures another checkout's package too;
give it once per tree for several).
Rows ``spool`` and ``async-spool`` publish through ``spool=DIR`` (``persist()`` every 10,000);
callgrind counts no time in the kernel, so their writes and fsyncs are not in the figure.
Rows ``consume``, ``async-consume`` and ``async-consume-16`` (issue 47) count instructions per
*consumed* message instead: this process fills a fresh queue (not counted), and the child consumes
it with ``consume.py``'s rows (prefetch 200, a no-op handler, each message acked):

    bash scripts/dev.sh run python benchmarks/instructions.py \\
        --only async-consume,async-consume-16 --counts 10000,30000 --compare /tmp/before/src

Needs valgrind (``apt-get install valgrind``). A row takes about a minute per tree.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
#: this checkout's package (not whatever the environment has installed)
SRC = os.path.join(os.path.dirname(HERE), "src")
URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
#: row key -> what it runs
ROWS = {
    "publish": "Publisher.publish()",
    "many": "Publisher.publish_many(1000)",
    "async": "AsyncPublisher.publish()",
    "async-many": "AsyncPublisher.publish_many(1000)",
    "spool": "Publisher.publish(), spool",
    "async-spool": "AsyncPublisher.publish(), spool",
    "consume": "Consumer, no-op handler (per message)",
    "async-consume": "AsyncConsumer, no-op (per message)",
    "async-consume-16": "AsyncConsumer concurrency=16 (per msg)",
}
#: rows that consume (issue 47): the parent fills the queue, only the consuming is counted
CONSUME_ROWS = {"consume": 1, "async-consume": 1, "async-consume-16": 16}
BATCH = 1000


def child(row: str, count: int, size: int, url: str, queue: str | None = None) -> int:
    """The measured process: publish ``count`` messages the way ``row`` says (the loops of
    ``client_cpu.py``), every one confirmed; returns how many were. A consume row consumes
    ``count`` messages from ``queue`` instead (``consume.py``'s rows, prefetch 200, each
    acked)."""
    sys.path.insert(0, HERE)
    if row in CONSUME_ROWS:
        import consume

        assert queue is not None
        if row == "consume":
            consume.reliable_consumer(url, queue, count, consume.PREFETCH)
        else:
            concurrency = CONSUME_ROWS[row]
            consume.reliable_async_consumer(url, queue, count, consume.PREFETCH, concurrency)
        return count
    import client_cpu

    measures = {
        "publish": client_cpu.sync_row,
        "many": client_cpu.sync_row,
        "async": client_cpu.async_row,
        "async-many": client_cpu.async_row,
        "spool": client_cpu.spool_row,  # persist() every 10,000, as client_cpu.py --spool
        "async-spool": client_cpu.async_spool_row,
    }
    measure = measures[row]
    measure(url, count, b"x" * size, BATCH if row.endswith("many") else 0, 1)  # asserts all
    return count


def instructions(row: str, count: int, args: argparse.Namespace, src: str) -> int:
    """Instructions callgrind counted for one child run (every thread), importing the package
    from ``src``. For a consume row, its queue is filled first, by this process (not counted)."""
    if row not in CONSUME_ROWS:
        return _valgrind(row, count, args, src, [])
    sys.path.insert(0, HERE)
    import consume

    with consume.filled_queue(args.url, count, b"x" * args.size) as queue:
        figure = _valgrind(row, count, args, src, ["--queue", queue])
        left = consume.ready(args.url, queue)
    if left:
        raise SystemExit(f"{row} ({count} messages) left {left} in its queue")
    return figure


def _valgrind(row: str, count: int, args: argparse.Namespace, src: str, extra: list[str]) -> int:
    env = dict(os.environ, PYTHONPATH=src)
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    command += [sys.executable, os.path.abspath(__file__), "--child", row, "--url", args.url]
    command += ["--counts", f"{count},{count}", "--size", str(args.size), *extra]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise SystemExit(f"{row} ({count} messages) failed under valgrind:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    publishing = ",".join(key for key in ROWS if key not in CONSUME_ROWS)
    parser.add_argument(
        "--only", default=publishing, help=f"rows (default: {publishing}), of {','.join(ROWS)}"
    )
    parser.add_argument("--counts", default="20000,60000", help="the two runs' message counts")
    parser.add_argument("--size", type=int, default=12)
    parser.add_argument(
        "--compare",
        metavar="SRC",
        action="append",
        default=[],
        help="also measure the package in SRC (repeatable: one column per tree)",
    )
    parser.add_argument("--url", default=URL)
    parser.add_argument("--child", metavar="ROW", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    args = parser.parse_args()
    small, large = (int(n) for n in args.counts.split(","))
    if args.child:
        done = "consumed" if args.child in CONSUME_ROWS else "confirmed"
        print(f"{child(args.child, small, args.size, args.url, args.queue)} {done}")
        return 0
    rows = [key for key in args.only.split(",") if key]
    if unknown := set(rows) - set(ROWS):
        parser.error(f"--only: unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}")
    if large <= small or small % BATCH or large % BATCH:
        parser.error("--counts: two multiples of 1000, the second larger")
    if shutil.which("valgrind") is None:
        parser.error("needs valgrind: apt-get install valgrind")
    trees = [("this tree", SRC)]
    trees += [(src, src) for src in args.compare]
    print(
        f"== instructions per message, confirmed (consume rows: consumed and acked) "
        f"({args.size} B, runs of {small:,} and {large:,}) =="
    )
    header = f"{'row':<36}" + "".join(f" {name[-24:]:>24}" for name, _ in trees)
    print(header)
    for row in rows:
        figures = []
        for _, src in trees:
            a = instructions(row, small, args, src)
            b = instructions(row, large, args, src)
            figures.append((b - a) / (large - small))
        print(f"{ROWS[row]:<36}" + "".join(f" {figure:>24,.0f}" for figure in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
