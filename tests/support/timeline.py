"""Where the suite's time and CPU go: one JSON line per test, when ``RELIABLE_AMQP_TIMELINE``
names a directory (``scripts/timeline.py`` sums the lines by directory and unit).

Each line: the worker (``gw0``, ``gw1``, or ``main``), the test's node id, its wall-clock start
and end, the CPU seconds this process and its waited-for children spent on it, and the machine's
busy CPU seconds over the same interval (``/proc/stat``: every process, the broker's and the
JVMs' included; with two workers, both workers' tests share it).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DIRECTORY = os.environ.get("RELIABLE_AMQP_TIMELINE", "")
_TICK = os.sysconf("SC_CLK_TCK")


def _machine_busy() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    values = [int(value) for value in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return (sum(values[:8]) - idle) / _TICK


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Times ``item`` (setup, call and teardown) and appends its line."""
    if not DIRECTORY:
        yield
        return
    start, own, children, busy = (
        time.time(),
        _cpu(resource.RUSAGE_SELF),
        _cpu(resource.RUSAGE_CHILDREN),
        _machine_busy(),
    )
    yield
    worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
    line = {
        "worker": worker,
        "nodeid": item.nodeid,
        "start": start,
        "end": time.time(),
        "cpu": round(_cpu(resource.RUSAGE_SELF) - own, 3),
        "children": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
        "machine": round(_machine_busy() - busy, 3),
    }
    _append(f"{worker}.jsonl", line)


def record_command(command: tuple[str, ...], start: float) -> None:
    """A line for a broker CLI call (``rabbitmqctl``...) that began at ``start`` (``time.time()``)
    and ends now, with the test it ran for, when ``RELIABLE_AMQP_TIMELINE`` is set."""
    if not DIRECTORY:
        return
    line = {
        "command": list(command),
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "start": start,
        "end": time.time(),
    }
    _append(f"commands-{os.getpid()}.jsonl", line)


def _append(name: str, line: dict[str, object]) -> None:
    """One JSON line at the end of ``name`` in the timeline's directory."""
    Path(DIRECTORY).mkdir(parents=True, exist_ok=True)
    with open(Path(DIRECTORY) / name, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
