"""A process that dies by SIGKILL loses nothing it had made durable with ``persist()``.

A child appends messages and calls ``persist()`` every 5,000, telling the parent each time how
many are durable; the parent kills it with SIGKILL at a random point. The reopened spool must
hold exactly a prefix of what the child appended, in order, at least as long as the last count
the child reported (the rest of what it appended may or may not be there: its commits survive a
process crash too, only not yet reported).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reliable_amqp._spool import Spool

CHILD = r"""
import sys
from reliable_amqp._core.builder import build_message
from reliable_amqp._spool import Spool

directory, policy, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
spool = Spool(directory, fsync=policy)
print("open", flush=True)
i = start
while True:
    spool.append(build_message("", "q", b"x" * 200, properties={"message_id": f"m-{i}"}))
    i += 1
    if i % 5000 == 0:
        assert spool.persist() == 0
        print(i, flush=True)
"""


def _stored_ids(directory: Path) -> list[str]:
    spool = Spool(directory)
    try:
        ids: list[str]
        ids, after, size = [], 0, 0
        while entries := spool.read(after, 10_000):
            ids.extend(e.message.message_id for e in entries)
            size += sum(e.size for e in entries)
            after = entries[-1].seq
        # the counts kept beside the table were committed with it
        assert (spool.pending, spool.pending_bytes) == (len(ids), size)
        return ids
    finally:
        spool.close()


@pytest.mark.parametrize("policy", ["commit", "persist", "never"])
def test_sigkill_loses_nothing_persisted(tmp_path: Path, policy: str) -> None:
    directory = tmp_path / "spool"
    rng = random.Random()
    start = 0
    for _round in range(2):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(directory), policy, str(start)],
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"open"
        durable = start
        kill_after = rng.uniform(0.2, 0.8)
        started = time.monotonic()
        fd = child.stdout.fileno()
        os.set_blocking(fd, False)
        partial = b""  # a read may end inside a line

        def take(chunk: bytes, durable: int) -> int:
            nonlocal partial
            *lines, partial = (partial + chunk).split(b"\n")
            return int(lines[-1]) if lines else durable

        # past kill_after, and once the child made something durable (a loaded machine can
        # take longer than kill_after for the first 5,000)
        while time.monotonic() - started < kill_after or durable == start:
            assert time.monotonic() - started < 60, "the child reported nothing durable"
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                chunk = b""
            if chunk:
                durable = take(chunk, durable)
            else:
                time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait()
        os.set_blocking(fd, True)
        while chunk := os.read(fd, 65536):
            durable = take(chunk, durable)  # a last line the kill cut (no newline) was not reported
        ids = _stored_ids(directory)
        # exactly a prefix of what was appended, in order, nothing persisted missing
        assert ids == [f"m-{i}" for i in range(len(ids))]
        assert len(ids) >= durable > start, (len(ids), durable)
        start = len(ids)
