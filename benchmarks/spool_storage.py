"""What the spool's storage costs a message, apart from the publisher: the segment log alone.

    bash scripts/dev.sh run python benchmarks/spool_storage.py              # 200,000 x 12 B
    bash scripts/dev.sh run python benchmarks/spool_storage.py --size 1024

Rows, CPU per message (``time.process_time()``: every thread, the spool's writer included),
median of ``--repeat`` passes; each pass goes through one spool, as a publisher's messages do
through an outage:

- ``encode``: the stored record of each message (``_codec.encode``), nothing written;
- ``Spool.append + persist() every 10,000``: ``Spool.encode()`` and ``Spool.append()`` of every
  message from one thread (as a spooled ``publish()`` does), ``persist()`` every 10,000 and at
  the end (segment writes, an fsync and the ledger's marks);
- ``open (every record checked)``: the spool closed and opened again, which reads every pending
  record and checks its checksum;
- ``read back``: ``Spool.read(after, 1000)`` of the whole backlog, in order, records checked
  and decoded (what the drain after an outage reads);
- ``remove on confirm``: ``Spool.remove(seqs, size)`` of every message, in batches of 500 with
  their bytes as ``Spool.encode()`` counted them, until ``pending`` is 0 and every segment is
  deleted (the ledger's ranges, the files given back);
- ``bare file append + fsync``: the same records (encoded, a CRC-32 and a header each, as the
  segments hold them) appended to one file in writes of 1,000, ``fsync`` every 10,000: the floor
  under the append row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.message import OutgoingMessage
from reliable_amqp._spool import Spool, _codec, _files

PERSIST_EVERY = 10_000
REMOVE_BATCH = 500
READ_BATCH = 1000

ROWS = (
    "encode",
    "Spool.append + persist() every 10,000",
    "open (every record checked)",
    "read back",
    "remove on confirm",
    "bare file append + fsync",
)


def encode(messages: list[OutgoingMessage]) -> float:
    """CPU seconds to encode every record."""
    started = time.process_time()
    for message in messages:
        _codec.encode(message)
    return time.process_time() - started


def segments_left(directory: str) -> bool:
    """Whether any segment file is still in the spool directory."""
    return bool(_files.list_segments(directory))


def segment_log(messages: list[OutgoingMessage]) -> dict[str, float]:
    """CPU seconds of each step of one spool's life: append, open, read back, remove."""
    seconds: dict[str, float] = {}
    count = len(messages)
    with tempfile.TemporaryDirectory(prefix="ra-bench-storage-") as directory:
        spool = Spool(directory)
        try:
            sizes: list[int] = []
            started = time.process_time()
            for i, message in enumerate(messages, 1):
                meta, size = spool.encode(message)
                spool.append(message, 0, meta)
                sizes.append(size)
                if not i % PERSIST_EVERY:
                    spool.persist()
            spool.persist()
            seconds[ROWS[1]] = time.process_time() - started
        finally:
            spool.close()

        started = time.process_time()
        spool = Spool(directory)
        seconds[ROWS[2]] = time.process_time() - started
        try:
            if spool.pending != count:
                raise RuntimeError(f"reopened with {spool.pending:,} of {count:,} pending")
            started = time.process_time()
            after = read = 0
            while entries := spool.read(after, READ_BATCH):
                after = entries[-1].seq
                read += len(entries)
            seconds[ROWS[3]] = time.process_time() - started
            if read != count:
                raise RuntimeError(f"read back {read:,} of {count:,}")

            started = time.process_time()
            for low in range(1, count + 1, REMOVE_BATCH):
                high = min(low + REMOVE_BATCH, count + 1)
                spool.remove(range(low, high), sum(sizes[low - 1 : high - 1]))
            while spool.pending or segments_left(directory):
                time.sleep(0.001)
            seconds[ROWS[4]] = time.process_time() - started
        finally:
            spool.close()
    return seconds


def bare_file(messages: list[OutgoingMessage]) -> float:
    """CPU seconds to append the same records to a file, fsync every PERSIST_EVERY."""
    pack = _files.RECORD.pack
    crc32 = _files.record_crc
    with tempfile.TemporaryDirectory(prefix="ra-bench-storage-") as directory:
        fd = os.open(os.path.join(directory, "segment"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            started = time.process_time()
            parts: list[bytes] = []
            for seq, message in enumerate(messages, 1):
                meta = _codec.encode(message)
                body = message.body
                parts += (pack(crc32(seq, meta, body), seq, len(meta), len(body)), meta, body)
                if len(parts) >= 3000:
                    os.write(fd, b"".join(parts))
                    parts.clear()
                if not seq % PERSIST_EVERY:
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
    rows: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(args.repeat):
        rows[ROWS[0]].append(encode(messages))
        for name, cpu in segment_log(messages).items():
            rows[name].append(cpu)
        rows[ROWS[5]].append(bare_file(messages))
    print(f"\n== spool storage: {args.count:,} x {args.size} B, median of {args.repeat} ==")
    for name, seconds in rows.items():
        print(f"{name:<40} {statistics.median(seconds) / args.count * 1e6:6.2f} us a message")
    return 0


if __name__ == "__main__":
    sys.exit(main())
