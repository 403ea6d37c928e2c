"""Memory at two sizes far apart: a test's child process reports its RSS growth at marks.

A bound on memory is a bound only if it holds at 100,000 messages and at 400,000 alike. The
measuring part runs in a child process (its resident set is its own, not pytest's), started with
the test module as its script; it prints its figures as JSON on its last line.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from reliable_amqp import Publisher

#: messages handled before the baseline is taken (caches, the allocator's first arenas)
WARM_UP = 2_000
#: messages after the baseline at which growth is reported
MARKS = (100_000, 400_000)
#: how much the resident set may grow between the two marks: 10 MB is 35 bytes a message
FLAT = 10 * 2**20
#: how many more memory blocks Python's allocator may hold at the second mark than at the first
#: (``sys.getallocatedblocks()``, after a collection): one object kept per message is 300,000;
#: what is in flight when a sample is taken (up to a prefetch of deliveries, a batch of rows)
#: moves it by up to 80,000 either way
FLAT_BLOCKS = 150_000


def rss() -> int:
    """This process's resident set size, in bytes."""
    return int(psutil.Process().memory_info().rss)


def sample() -> tuple[int, int]:
    """(resident set size in bytes, memory blocks Python's allocator holds) of this process,
    after a garbage collection."""
    gc.collect()
    return rss(), sys.getallocatedblocks()


def fill_numbered(url: str, queue: str, count: int, *, size: int = 100, **properties: Any) -> None:
    """Publish ``count`` messages of ``size`` bytes, each body distinct, all confirmed
    (``properties``: the publisher's, ``delivery_mode=1`` say)."""
    with Publisher(url, max_in_flight=10_000) as publisher:
        for first in range(0, count, 10_000):
            last = min(count, first + 10_000)
            publisher.publish_many(
                "",
                queue,
                [b"%08d" % i + b"x" * (size - 8) for i in range(first, last)],
                **properties,
            )
        assert publisher.flush(600) == 0


def run_child(script: str, *args: str, timeout: float = 900) -> Any:
    """Run ``script`` (a test module's ``__main__``) with ``tests/`` importable; its last line."""
    env = dict(os.environ)
    tests = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.splitlines()[-1])


def check_flat(
    what: str, grown: list[list[int]], *, ceiling: int = 40 * 2**20, flat: int = FLAT
) -> None:
    """Growth at ``MARKS``, each (RSS bytes, Python memory blocks): printed, under ``ceiling``
    in all, and flat between the marks (RSS by ``flat``; Python's blocks by ``FLAT_BLOCKS``)."""
    (small, small_blocks), (large, large_blocks) = grown
    print(
        f"{what}: RSS {small / 2**20:+.1f} MB, {small_blocks:+,} Python blocks after "
        f"{MARKS[0]:,} messages; {large / 2**20:+.1f} MB, {large_blocks:+,} after {MARKS[1]:,}"
    )
    assert large < ceiling, f"{what}: RSS grew {large / 2**20:.1f} MB over {MARKS[1]:,} messages"
    assert large - small < flat, (
        f"{what}: RSS grew {(large - small) / 2**20:.1f} MB from {MARKS[0]:,} to "
        f"{MARKS[1]:,} messages"
    )
    assert large_blocks - small_blocks < FLAT_BLOCKS, (
        f"{what}: {large_blocks - small_blocks:,} more Python memory blocks held after "
        f"{MARKS[1]:,} messages than after {MARKS[0]:,}"
    )
