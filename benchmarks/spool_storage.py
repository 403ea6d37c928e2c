"""What the spool's storage costs a message, apart from the publisher: SQLite against a bare file.

    bash scripts/dev.sh run python benchmarks/spool_storage.py              # 200,000 x 12 B
    bash scripts/dev.sh run python benchmarks/spool_storage.py --size 1024

Rows, CPU per message (``time.process_time()``: the spool's writer thread included), median of
``--repeat`` passes:

- ``encode``: the stored record of each message (``_codec.encode``), nothing written;
- ``SQLite append + persist``: ``Spool.append()`` of every message, ``persist()`` every 10,000
  (insert, commit, fsync), as a spooled publish does;
- ``SQLite remove``: then every message removed again as confirms remove them (ranges of 500),
  until committed;
- ``file append + fsync``: the same records (encoded, a CRC-32 and a header each) appended to
  one file in writes of 1,000, ``fsync`` every 10,000: what a log of segment files would do for
  the append; its removal would be a ledger's watermark, nothing a message.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import tempfile
import time
import zlib

from reliable_amqp._core.message import OutgoingMessage, build_message
from reliable_amqp._spool import Spool, _codec

PERSIST_EVERY = 10_000


def encode(messages: list[OutgoingMessage]) -> float:
    """CPU seconds to encode every record."""
    started = time.process_time()
    for message in messages:
        _codec.encode(message)
    return time.process_time() - started


def sqlite(messages: list[OutgoingMessage]) -> tuple[float, float]:
    """CPU seconds to append (and persist) every message, then to remove them all."""
    with tempfile.TemporaryDirectory(prefix="ra-bench-storage-") as directory:
        spool = Spool(directory)
        try:
            started = time.process_time()
            for i, message in enumerate(messages, 1):
                meta, _size = spool.encode(message)
                spool.append(message, 0, meta)
                if not i % PERSIST_EVERY:
                    spool.persist()
            spool.persist()
            appended = time.process_time() - started
            started = time.process_time()
            for low in range(1, len(messages) + 1, 500):
                spool.remove(range(low, min(low + 500, len(messages) + 1)))
            spool.persist()  # a commit after the removals: they are in it
            while spool.pending:
                time.sleep(0.001)
            removed = time.process_time() - started
        finally:
            spool.close()
    return appended, removed


def bare_file(messages: list[OutgoingMessage]) -> float:
    """CPU seconds to append the same records to a file, fsync every PERSIST_EVERY."""
    header = struct.Struct(">IIQII")  # crc, size, seq, meta size, body size
    with tempfile.TemporaryDirectory(prefix="ra-bench-storage-") as directory:
        fd = os.open(os.path.join(directory, "segment"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            started = time.process_time()
            parts: list[bytes] = []
            for i, message in enumerate(messages, 1):
                meta = _codec.encode(message)
                body = message.body
                crc = zlib.crc32(body, zlib.crc32(meta))
                parts.append(header.pack(crc, len(meta) + len(body), i, len(meta), len(body)))
                parts.append(meta)
                parts.append(body)
                if len(parts) >= 3000:
                    os.write(fd, b"".join(parts))
                    parts.clear()
                if not i % PERSIST_EVERY:
                    os.fsync(fd)
            os.write(fd, b"".join(parts))
            os.fsync(fd)
            return time.process_time() - started
        finally:
            os.close(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    messages = [build_message("", "q", b"x" * args.size) for _ in range(args.count)]
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeat):
        rows.setdefault("encode", []).append(encode(messages))
        appended, removed = sqlite(messages)
        rows.setdefault("SQLite append + persist", []).append(appended)
        rows.setdefault("SQLite remove", []).append(removed)
        rows.setdefault("file append + fsync", []).append(bare_file(messages))
    print(f"\n== spool storage: {args.count:,} x {args.size} B, median of {args.repeat} ==")
    for name, seconds in rows.items():
        print(f"{name:<28} {statistics.median(seconds) / args.count * 1e6:6.2f} us a message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
