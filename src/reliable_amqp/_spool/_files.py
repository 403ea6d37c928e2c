"""The spool's files: segments of records, the ledger, the failed log; writing and reading them.

A spool directory holds (besides ``spool.lock``)::

    spool-00000000000000000001.seg   records appended in seq order (one segment file per ~16 MiB)
    spool.ledger                     what left the pending set (seq ranges) and what is durable
    spool.failed                     messages that failed for good, with their reasons

Every file starts with an 8-byte magic whose last byte is the format version; a file of a newer
version is refused, never rewritten. Numbers are big-endian.

- A **segment** (``RAMQSEG\\x01`` + u64 first seq) holds records ``u32 crc | u64 seq |
  u32 meta size | u32 body size | meta | body``; ``crc`` is the CRC-32 of meta then body,
  XORed with the seq folded to 32 bits (``(seq ^ seq >> 32) & 0xFFFFFFFF``): a record read in
  the wrong place, or with a changed seq or size, does not check. Seqs rise from record to
  record (with gaps: a message confirmed before the writer got to it is never written).
  Segments are written in seq order and never rewritten: a segment whose every seq left the
  pending set is deleted whole.
- The **ledger** (``RAMQLDG\\x01``) holds records ``u32 crc | u8 kind | u64 a | u64 b``:
  kind ``R``, the seqs ``a`` to ``b`` left the pending set (confirmed, or moved to the failed
  log); kind ``S``, the segment whose first seq is ``a`` holds whole, durable records up to byte
  ``b``. A record past the last ``S`` mark that does not check is the tail of a write a crash cut
  short and is cut off when the spool opens; one before it is damage, and opening refuses.
  The ledger is rewritten (to a new file, renamed over the old one) when it grows.
- The **failed log** (``RAMQFLD\\x01``) holds records ``u32 crc | u64 seq | f64 failed at |
  u32 reason size | u32 meta size | u32 body size | reason | meta | body``.

``meta`` is :func:`reliable_amqp._spool._codec.encode`'s record of everything but the body.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import math
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from reliable_amqp._core.errors import SpoolError

SEGMENT_MAGIC = b"RAMQSEG\x01"
LEDGER_MAGIC = b"RAMQLDG\x01"
FAILED_MAGIC = b"RAMQFLD\x01"
LEDGER_NAME = "spool.ledger"
FAILED_NAME = "spool.failed"
SEGMENT_PREFIX = "spool-"
SEGMENT_SUFFIX = ".seg"
#: a segment is closed and a new one started once it holds this many bytes
SEGMENT_BYTES = 16 * 1024 * 1024

SEGMENT_HEAD = struct.Struct(">8sQ")
RECORD = struct.Struct(">IQII")
LEDGER_RECORD = struct.Struct(">IBQQ")
FAILED_HEAD = struct.Struct(">QdIII")
FAILED_RECORD = struct.Struct(">IQdIII")
U32 = struct.Struct(">I")
REMOVED, SYNCED = ord("R"), ord("S")
_crc32 = zlib.crc32
#: bytes read from a segment at a time
READ_BYTES = 1024 * 1024


def segment_name(first: int) -> str:
    """The file name of the segment whose first record has seq ``first``."""
    return f"{SEGMENT_PREFIX}{first:020d}{SEGMENT_SUFFIX}"


def segment_first(name: str) -> int | None:
    """The first seq a segment's file name says, or None for a file that is no segment."""
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]
    return int(digits) if len(digits) == 20 and digits.isdigit() else None


def describe(exc: BaseException) -> str:
    """What an OS error was, in words."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return str(exc) or type(exc).__name__


def is_disk_full(exc: BaseException) -> bool:
    """Whether an error means the disk (file system) is full."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def sync_directory(directory: str) -> None:
    """Make the directory's entries (files made, renamed, deleted) durable."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until all of ``data`` is written."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def replace_file(path: str, data: bytes, *, keep_open: bool = False) -> int | None:
    """Write ``data`` as the whole file ``path``, durably: to ``path.new``, fsynced, renamed
    over ``path``, the directory fsynced. Returns the file's descriptor (open for writing) with
    ``keep_open``. Raises OSError."""
    temp = path + ".new"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
        os.replace(temp, path)
    except BaseException:
        os.close(fd)
        raise
    sync_directory(os.path.dirname(path))
    if keep_open:
        return fd
    os.close(fd)
    return None


def record_crc(seq: int, meta: bytes | memoryview, body: bytes | memoryview) -> int:
    """A segment record's checksum: CRC-32 of meta then body, XORed with the seq folded to 32
    bits (a flipped bit of the seq changes it as one of the data does)."""
    return _crc32(body, _crc32(meta)) ^ (seq ^ seq >> 32) & 0xFFFFFFFF


def record(seq: int, meta: bytes, body: bytes) -> bytes:
    """A whole segment record: its header, ``meta`` and ``body``."""
    return RECORD.pack(record_crc(seq, meta, body), seq, len(meta), len(body)) + meta + body


def ledger_record(kind: int, a: int, b: int) -> bytes:
    """One ledger record."""
    rest = LEDGER_RECORD.pack(0, kind, a, b)[4:]
    return U32.pack(_crc32(rest)) + rest


def failed_record(seq: int, failed_at: float, reason: str, meta: bytes, body: bytes) -> bytes:
    """One failed-log record."""
    text = reason.encode("utf-8", "surrogatepass")
    head = FAILED_HEAD.pack(seq, failed_at, len(text), len(meta), len(body))
    return (
        U32.pack(_crc32(body, _crc32(meta, _crc32(text, _crc32(head))))) + head + text + meta + body
    )


# --- what left the pending set ------------------------------------------------------------------


class Removed:
    """The seqs that left the pending set: every seq below :attr:`floor`, and sorted disjoint
    ranges above it. Confirms arrive close to seq order, so the ranges stay few (the in-flight
    window's disorder); memory does not grow with the backlog."""

    __slots__ = ("floor", "highs", "lows")

    def __init__(self) -> None:
        self.floor = 1
        self.lows: list[int] = []
        self.highs: list[int] = []

    def add(self, low: int, high: int) -> None:
        """Seqs ``low`` to ``high`` (both included) left the pending set."""
        lows, highs = self.lows, self.highs
        if low <= self.floor:
            if high >= self.floor:
                self.floor = high + 1
                while lows and lows[0] <= self.floor:
                    self.floor = max(self.floor, highs[0] + 1)
                    del lows[0], highs[0]
            return
        at = bisect.bisect_left(highs, low - 1)  # the first range that may touch [low, high]
        end = at
        while end < len(lows) and lows[end] <= high + 1:
            low = min(low, lows[end])
            high = max(high, highs[end])
            end += 1
        lows[at:end] = [low]
        highs[at:end] = [high]

    def __contains__(self, seq: int) -> bool:
        if seq < self.floor:
            return True
        lows = self.lows
        if not lows:
            return False
        at = bisect.bisect_right(lows, seq) - 1
        return at >= 0 and seq <= self.highs[at]

    def first_low_above(self, seq: int) -> int | float:
        """The lowest seq above ``seq`` that may have left by a range (not the floor): a
        reader checks membership only from there on (``inf``: no range above)."""
        at = bisect.bisect_right(self.highs, seq)  # the first range that ends above seq
        return self.lows[at] if at < len(self.lows) else math.inf

    def covers(self, low: int, high: int) -> bool:
        """Whether every seq from ``low`` to ``high`` left."""
        if high < self.floor:
            return True
        low = max(low, self.floor)
        at = bisect.bisect_right(self.lows, low) - 1
        return at >= 0 and self.highs[at] >= high

    def ranges(self) -> list[tuple[int, int]]:
        """The ranges, the floor's as ``(1, floor - 1)`` when it is above 1."""
        head = [(1, self.floor - 1)] if self.floor > 1 else []
        return head + list(zip(self.lows, self.highs, strict=True))

    def copy(self) -> Removed:
        """A snapshot (a reader's, while the writer goes on)."""
        other = Removed()
        other.floor = self.floor
        other.lows = list(self.lows)
        other.highs = list(self.highs)
        return other

    @property
    def top(self) -> int:
        """The highest seq known removed (0: none)."""
        return self.highs[-1] if self.highs else self.floor - 1


def runs(seqs: list[int]) -> list[tuple[int, int]]:
    """Seqs as (first, last) runs of consecutive numbers, in sorted order."""
    seqs = sorted(seqs)
    out: list[tuple[int, int]] = []
    if not seqs:
        return out
    if seqs[-1] - seqs[0] + 1 == len(seqs) == len(set(seqs)):  # the usual case: one run
        return [(seqs[0], seqs[-1])]
    low = high = seqs[0]
    for seq in seqs[1:]:
        if seq == high + 1:
            high = seq
        elif seq != high:
            out.append((low, high))
            low = high = seq
    out.append((low, high))
    return out


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint (first, last) runs, sorted, adjacent ones joined (what confirms in seq order
    give, a few a batch, becomes one)."""
    if len(runs) < 2:
        return runs
    out: list[tuple[int, int]] = []
    low, high = -2, -2
    for first, last in sorted(runs):
        if first <= high + 1:
            high = max(high, last)
            continue
        if high >= 0:
            out.append((low, high))
        low, high = first, last
    out.append((low, high))
    return out


def cut_runs(rows: list[bytes], first: int, runs: list[tuple[int, int]]) -> list[bytes]:
    """``rows`` (seqs ``first`` on, one each) without those of the sorted disjoint ``runs``:
    slices, not a test per row."""
    last = first + len(rows) - 1
    if not rows or runs[-1][1] < first or runs[0][0] > last:
        return rows
    kept: list[bytes] = []
    at = first  # the first seq not yet kept or dropped
    for low, high in runs:
        if high < at:
            continue
        if low > last:
            break
        if low > at:
            kept += rows[at - first : low - first]
        at = high + 1
    if at <= last:
        kept += rows[at - first :]
    return kept


# --- reading the files --------------------------------------------------------------------------


@dataclass
class Ledger:
    """What a ledger file says: the removed seqs, and how far each segment is durable."""

    removed: Removed = field(default_factory=Removed)
    #: first seq of a segment -> bytes of it known whole and durable
    synced: dict[int, int] = field(default_factory=dict)
    #: bytes of the file that hold whole, checked records (a cut tail beyond is dropped)
    good_bytes: int = len(LEDGER_MAGIC)
    size: int = 0


def _read_file(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SpoolError(f"cannot read {path}: {describe(exc)}") from exc


def _check_magic(path: str, data: bytes, magic: bytes, what: str) -> None:
    if data[:7] != magic[:7]:
        raise SpoolError(f"{path} is not a reliable-amqp spool {what} (it starts {data[:8]!r})")
    if data[7] > magic[7]:
        raise SpoolError(
            f"{path} was written by a newer version of reliable-amqp (spool {what} format "
            f"{data[7]}; this version reads {magic[7]}): upgrade to read it"
        )
    if data[7] != magic[7]:
        raise SpoolError(f"{path} is a damaged spool {what}: format {data[7]}")


def read_ledger(path: str) -> Ledger | None:
    """The ledger at ``path`` (None when there is none). A record that does not check at the end
    of the file is a write cut short (:attr:`Ledger.good_bytes` stops before it); one followed by
    records that do check is damage: :class:`SpoolError`."""
    data = _read_file(path)
    if data is None:
        return None
    ledger = Ledger(size=len(data))
    if len(data) < len(LEDGER_MAGIC):
        ledger.good_bytes = 0  # made, never written whole: rewritten when the spool opens
        return ledger
    _check_magic(path, data, LEDGER_MAGIC, "ledger")
    at, size, step = len(LEDGER_MAGIC), len(data), LEDGER_RECORD.size
    removed, synced = ledger.removed, ledger.synced
    while at + step <= size:
        crc, kind, a, b = LEDGER_RECORD.unpack_from(data, at)
        if _crc32(data[at + 4 : at + step]) != crc or kind not in (REMOVED, SYNCED):
            if _any_good_ledger_record(data, at + 1):
                raise SpoolError(
                    f"{path} is damaged at byte {at} (a record whose checksum does not match, "
                    "with whole records after it); it was left in place"
                )
            break
        if kind == REMOVED:
            if a < 1 or b < a:
                raise SpoolError(f"{path}: a damaged range {a}..{b} at byte {at}")
            removed.add(a, b)
        else:
            synced[a] = max(synced.get(a, 0), b)
        at += step
    ledger.good_bytes = at
    return ledger


def _any_good_ledger_record(data: bytes, start: int) -> bool:
    step = LEDGER_RECORD.size
    for at in range(start, len(data) - step + 1):
        crc, kind, _a, _b = LEDGER_RECORD.unpack_from(data, at)
        if kind in (REMOVED, SYNCED) and _crc32(data[at + 4 : at + step]) == crc:
            return True
    return False


@dataclass(frozen=True, slots=True)
class FailedRecord:
    """A record of the failed log."""

    seq: int
    failed_at: float
    reason: str
    meta: bytes
    body: bytes

    @property
    def size(self) -> int:
        """Bytes it counted against ``spool_max_bytes`` while pending."""
        return len(self.meta) + len(self.body)


def read_failed(path: str) -> tuple[list[FailedRecord], int] | None:
    """The failed log's records and the bytes that hold whole ones (None: no file); a cut
    tail is left out, damage before whole records raises :class:`SpoolError`."""
    data = _read_file(path)
    if data is None:
        return None
    if len(data) < len(FAILED_MAGIC):
        return [], 0
    _check_magic(path, data, FAILED_MAGIC, "failed log")
    records: list[FailedRecord] = []
    at, size, step = len(FAILED_MAGIC), len(data), FAILED_RECORD.size
    while at + step <= size:
        crc, seq, failed_at, text_size, meta_size, body_size = FAILED_RECORD.unpack_from(data, at)
        end = at + step + text_size + meta_size + body_size
        if end > size or _crc32(data[at + 4 : end]) != crc:
            if end < size:
                raise SpoolError(
                    f"{path}: failed entry {seq} is damaged (its checksum or size does not "
                    "match what was written); it was left in place"
                )
            break  # the last write, cut short
        text_end = at + step + text_size
        meta_end = text_end + meta_size
        records.append(
            FailedRecord(
                seq,
                failed_at,
                data[at + step : text_end].decode("utf-8", "surrogatepass"),
                data[text_end:meta_end],
                data[meta_end:end],
            )
        )
        at = end
    return records, at


class Found(NamedTuple):
    """One record read from a segment (its crc checked). A tuple: a drain makes one a message."""

    seq: int
    offset: int
    end: int
    meta: bytes
    body: bytes


_new_tuple = tuple.__new__


class BadRecord(Exception):
    """A record that does not check (``seq`` None when its header is cut or makes no sense)."""

    def __init__(self, offset: int, seq: int | None) -> None:
        super().__init__(offset, seq)
        self.offset = offset
        self.seq = seq


def damaged(path: str, seq: int | None, offset: int) -> SpoolError:
    """The error for a segment record that does not check (``--check`` lists the same words)."""
    which = f"entry {seq}" if seq is not None else "an entry"
    return SpoolError(
        f"{path}: {which} at byte {offset} is damaged (its checksum or size does not match what "
        "was written); it was left in place"
    )


class Segment:
    """One segment file: its first and last seq and the bytes of whole records in it."""

    __slots__ = ("first", "last", "path", "size", "synced")

    def __init__(self, path: str, first: int, last: int, size: int, synced: int) -> None:
        self.path = path
        self.first = first
        #: the last seq written to it (first - 1 while it holds none)
        self.last = last
        #: bytes of whole records (the writer's committed end; readers stop there)
        self.size = size
        #: bytes known durable
        self.synced = synced

    def __repr__(self) -> str:
        return f"Segment({os.path.basename(self.path)}, {self.first}..{self.last}, {self.size})"


def records(path: str, start: int, end: int, *, after: int = 0) -> Iterator[Found]:
    """The records of the segment file ``path`` from byte ``start`` to ``end``, in order.

    Yields each whole record whose crc checks and whose seq rises above ``after``; raises
    :class:`BadRecord` at the first that does not. Nothing for a file deleted meanwhile.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # deleted since it was listed: every record in it left the pending set
    except OSError as exc:
        raise SpoolError(f"cannot read {path}: {describe(exc)}") from exc
    try:
        at = start
        buffer = b""
        base = start  # file offset of buffer[0]
        step = RECORD.size
        unpack = RECORD.unpack_from
        crc32 = _crc32
        while at < end:
            pos = at - base
            if pos + step > len(buffer):
                buffer = os.pread(fd, max(READ_BYTES, step), at)
                base, pos = at, 0
                if len(buffer) < step or at + step > end:
                    raise BadRecord(at, None)
            crc, seq, meta_size, body_size = unpack(buffer, pos)
            stop = at + step + meta_size + body_size
            if seq <= after or stop > end:
                raise BadRecord(at, seq if seq > after and stop <= end else None)
            if stop - base > len(buffer):
                buffer = os.pread(fd, max(READ_BYTES, stop - at), at)
                base, pos = at, 0
                if len(buffer) < stop - at:
                    raise BadRecord(at, None)
            body_at = pos + step + meta_size
            meta = buffer[pos + step : body_at]
            body = buffer[body_at : stop - base]
            if crc32(body, crc32(meta)) ^ (seq ^ seq >> 32) & 0xFFFFFFFF != crc:  # record_crc
                raise BadRecord(at, seq)
            yield _new_tuple(Found, (seq, at, stop, meta, body))  # Found(...), a third the cost
            after = seq
            at = stop
    except OSError as exc:
        raise SpoolError(f"cannot read {path}: {describe(exc)}") from exc
    finally:
        os.close(fd)


def segment_header(path: str, first: int) -> int:
    """Check the header of the segment ``path`` (named for ``first``); returns the file's size."""
    try:
        with open(path, "rb") as file:
            head = file.read(SEGMENT_HEAD.size)
            size = os.fstat(file.fileno()).st_size
    except OSError as exc:
        raise SpoolError(f"cannot read {path}: {describe(exc)}") from exc
    if len(head) < SEGMENT_HEAD.size:
        return size  # created, its header never written whole: the caller sees it is empty
    magic, named = SEGMENT_HEAD.unpack(head)
    _check_magic(path, magic, SEGMENT_MAGIC, "segment")
    if named != first:
        raise SpoolError(f"{path} is a damaged segment: its header says it starts at {named}")
    return size


def any_whole_record(path: str, start: int, end: int, after: int) -> int | None:
    """The offset of a record that checks somewhere past ``start`` (None: none): whether a
    record that does not check is the cut tail of the last write or damage with data after it."""
    try:
        with open(path, "rb") as file:
            file.seek(start)
            data = file.read(end - start)
    except OSError as exc:
        raise SpoolError(f"cannot read {path}: {describe(exc)}") from exc
    step = RECORD.size
    unpack = RECORD.unpack_from
    for pos in range(1, len(data) - step + 1):
        crc, seq, meta_size, body_size = unpack(data, pos)
        body_at = pos + step + meta_size
        stop = body_at + body_size
        if (
            seq > after
            and stop <= len(data)
            and record_crc(seq, data[pos + step : body_at], data[body_at:stop]) == crc
        ):
            return start + pos
    return None


def list_segments(directory: str) -> list[tuple[int, str]]:
    """(first seq, path) of the directory's segment files, in order."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise SpoolError(f"cannot read the spool directory {directory}: {describe(exc)}") from exc
    found = []
    for name in names:
        first = segment_first(name)
        if first is not None:
            found.append((first, os.path.join(directory, name)))
    found.sort()
    return found
