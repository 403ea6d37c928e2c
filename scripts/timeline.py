"""Sums a timeline of the suite (``RELIABLE_AMQP_TIMELINE=DIR scripts/dev.sh test``, see
``tests/support/timeline.py``): per worker, its span and the modules over 20 s it ran; per
directory of tests/, wall-clock seconds, this process's CPU, its children's and the machine's;
the broker CLI calls by command and by test; the longest tests.

    python scripts/timeline.py DIR [--top N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

Line = dict[str, Any]


def _read(files: list[Path]) -> list[Line]:
    return [
        json.loads(text) for file in files for text in file.read_text().splitlines() if text.strip()
    ]


def _directory(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0].removeprefix("tests/")
    return path.split("/", 1)[0] if "/" in path else "(top-level)"


def _workers(lines: list[Line], begin: float) -> None:
    by_worker: dict[str, list[Line]] = defaultdict(list)
    for line in lines:
        by_worker[line["worker"]].append(line)
    for worker, tests in sorted(by_worker.items()):
        tests.sort(key=lambda line: float(line["start"]))
        span = tests[-1]["end"] - tests[0]["start"]
        busy = sum(line["end"] - line["start"] for line in tests)
        print(
            f"\n{worker}: {len(tests)} tests, {tests[0]['start'] - begin:.0f} s to "
            f"{tests[-1]['end'] - begin:.0f} s, in tests {busy:.0f} s of {span:.0f} s"
        )
        module, first, last, count = "", 0.0, 0.0, 0
        for line in [*tests, {"nodeid": "", "start": 0.0, "end": 0.0}]:
            here = line["nodeid"].split("::", 1)[0]
            if here != module:
                if module and last - first >= 20:
                    print(f"  {first - begin:6.0f} s {last - first:6.0f} s  {module} ({count})")
                module, first, count = here, line["start"], 0
            last, count = line["end"], count + 1


def _directories(lines: list[Line]) -> None:
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)
    for line in lines:
        row = sums[_directory(line["nodeid"])]
        row[0] += line["end"] - line["start"]
        row[1] += line["cpu"]
        row[2] += line["children"]
        row[3] += line["machine"]
        row[4] += 1
    header = f"{'directory':<16}{'tests':>7}{'wall s':>9}{'cpu s':>9}{'child s':>9}"
    print(f"\n{header}{'machine s':>11}")
    total = [sum(row[i] for row in sums.values()) for i in range(5)]
    for name, row in [*sorted(sums.items(), key=lambda item: -item[1][0]), ("all", total)]:
        print(f"{name:<16}{row[4]:>7.0f}{row[0]:>9.0f}{row[1]:>9.0f}{row[2]:>9.0f}{row[3]:>11.0f}")


def _commands(commands: list[Line]) -> None:
    seconds = sum(c["end"] - c["start"] for c in commands)
    print(f"\n{len(commands)} broker CLI calls, {seconds:.0f} s in all")

    def by_command(command: Line) -> str:
        return " ".join(command["command"][:2])

    def by_test(command: Line) -> str:
        return str(command["test"]).rsplit("::", 1)[-1]

    for key, title in ((by_command, "by command"), (by_test, "by test")):
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for command in commands:
            name = key(command)
            sums[name][0] += 1
            sums[name][1] += command["end"] - command["start"]
        print(f"  {title}:")
        for name, (count, spent) in sorted(sums.items(), key=lambda item: -item[1][1])[:12]:
            print(f"    {count:5.0f} {spent:7.1f} s  {name[:90]}")


def main(argv: list[str]) -> int:
    """Prints the sums of the timeline in ``argv``'s directory."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    files = sorted(args.directory.glob("*.jsonl"))
    lines = _read([f for f in files if not f.name.startswith("commands-")])
    commands = _read([f for f in files if f.name.startswith("commands-")])
    if not lines:
        print(f"no timeline lines in {args.directory}", file=sys.stderr)
        return 1
    begin = min(line["start"] for line in lines)
    print(f"{len(lines)} tests, {max(line['end'] for line in lines) - begin:.0f} s first to last")
    _workers(lines, begin)
    _directories(lines)
    if commands:
        _commands(commands)
    print(f"\nthe {args.top} longest:")
    for line in sorted(lines, key=lambda line: float(line["start"] - line["end"]))[: args.top]:
        print(
            f"  {line['end'] - line['start']:6.1f} s  machine {line['machine']:6.1f}  "
            f"{line['worker']}  {line['nodeid']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
