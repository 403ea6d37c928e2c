"""A full disk: ``publish()`` (here ``append()``) raises SpoolFull, a PublishError that names the
spool; ``persist()`` says what is not durable; nothing committed before is lost; once there is
room again the writer catches up by itself and the accepted messages are all there, in order.

The disk is a real one: a tmpfs of a few MiB mounted for the test, which needs root (CI and
``scripts/dev.sh test`` run as root); without it the test fails saying so, it does not skip.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reliable_amqp import PublishError, SpoolError, SpoolFull
from reliable_amqp._spool import Spool
from support.spool import messages


class Disk:
    """A small tmpfs for a spool, that can be made larger."""

    def __init__(self, mountpoint: Path) -> None:
        self.path = mountpoint
        mountpoint.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, (
            f"cannot mount a tmpfs for the disk-full test (it needs root): {done.stderr.strip()}"
        )
        self.spool: Spool | None = None

    def open(self) -> Spool:
        self.spool = Spool(self.path / "spool")
        return self.spool

    def grow(self) -> None:
        subprocess.run(
            ["mount", "-o", "remount,size=64m", str(self.path)], check=True, capture_output=True
        )

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    disk = Disk(tmp_path / "disk")
    yield disk
    if disk.spool is not None:
        with contextlib.suppress(Exception):
            disk.spool.close(timeout=5)
    disk.unmount()


def _fill(spool: Spool) -> tuple[list[str], int, SpoolFull]:
    """Append until the spool refuses; returns (accepted ids, persisted count, the error)."""
    accepted: list[str] = []
    persisted = 0
    for message in messages(20_000, size=1000):
        try:
            spool.append(message)
        except SpoolFull as exc:
            return accepted, persisted, exc
        accepted.append(message.message_id)
        if len(accepted) % 200 == 0:
            try:
                assert spool.persist(timeout=10) == 0
                persisted = len(accepted)
            except SpoolError as exc:
                assert "not durable" in str(exc)
                assert "full" in str(exc)
    raise AssertionError("the disk never filled up")


def _ids(spool: Spool) -> list[str]:
    ids: list[str]
    ids, after = [], 0
    while entries := spool.read(after, 5000):
        ids.extend(e.message.message_id for e in entries)
        after = entries[-1].seq
    return ids


def test_a_full_disk_refuses_new_messages_and_catches_up_when_freed(disk: Disk) -> None:
    spool = disk.open()
    accepted, persisted, error = _fill(spool)
    assert persisted > 0
    assert isinstance(error, PublishError)
    assert isinstance(error, SpoolError)
    assert error.retriable
    assert error.message.message_id == f"m-{len(accepted)}"
    assert str(spool.directory) in str(error)
    assert "full" in str(error)
    with pytest.raises(SpoolError, match="not durable"):
        spool.persist(timeout=5)
    assert _ids(spool) == accepted[: len(_ids(spool))]  # what is committed is a prefix
    assert len(_ids(spool)) >= persisted

    disk.grow()
    deadline = time.monotonic() + 15
    while True:  # the writer retries by itself
        try:
            assert spool.persist(timeout=5) == 0
            break
        except SpoolError:
            assert time.monotonic() < deadline, "the writer did not catch up"
            time.sleep(0.2)
    more = messages(10, size=1000, start=len(accepted))
    for message in more:
        spool.append(message)
    spool.close()
    disk.spool = None
    again = Spool(disk.path / "spool")
    try:
        assert _ids(again) == accepted + [m.message_id for m in more]
    finally:
        again.close()


def test_closing_on_a_full_disk_keeps_what_was_persisted(disk: Disk) -> None:
    spool = disk.open()
    accepted, persisted, _error = _fill(spool)
    with pytest.raises(SpoolError, match="not written"):
        spool.close(timeout=0.5)
    disk.spool = None
    disk.grow()
    again = Spool(disk.path / "spool")
    try:
        ids = _ids(again)
        assert len(ids) >= persisted
        assert ids == accepted[: len(ids)]
    finally:
        again.close()
