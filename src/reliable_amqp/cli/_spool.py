"""``reliable-amqp spool DIR``: what a publisher's spool holds, and its failed messages.

Shows pending and failed counts and bytes (while a publisher has the spool open, too: reading
takes no lock). ``--export-failed FILE`` writes the failed messages as JSON lines that
``reliable-amqp publish --format jsonl FILE`` publishes again, with their message ids;
``--drop-failed`` empties the failed table (refused while a publisher has the spool open). Both
together drop exactly what was exported. ``--check`` reads everything and names what is damaged
(exit 1 then).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import sys
from typing import IO, Any

from reliable_amqp._core.errors import SpoolError
from reliable_amqp._spool import check, failed_entries, inspect
from reliable_amqp._spool import drop_failed as _drop_failed
from reliable_amqp._spool._inspect import FailedEntry
from reliable_amqp._spool._lock import in_use_by
from reliable_amqp.cli._io import ERROR_FIELD, _json_default, open_failed_file, set_properties
from reliable_amqp.cli._parse import EXIT_NOT_CONFIRMED, EXIT_OK, UsageError


def add_spool_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``reliable-amqp spool``."""
    parser.add_argument("directory", metavar="DIR", help="the spool directory (spool=DIR)")
    parser.add_argument(
        "--export-failed",
        metavar="FILE",
        help="write the failed messages to FILE as JSON lines (created 0600), which "
        "`reliable-amqp publish --format jsonl FILE` publishes again",
    )
    parser.add_argument(
        "--drop-failed",
        action="store_true",
        help="empty the failed table (with --export-failed: exactly what was exported); "
        "refused while a publisher has the spool open",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="read the whole spool (every page, every message's checksum) and list what is "
        "damaged; exit 1 when something is",
    )
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="show the library's log")


def run_spool(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp spool``; SpoolError and ConfigurationError reach the caller."""
    if args.drop_failed:
        holder = in_use_by(args.directory)
        if holder is not None:
            who = f"process {holder}" if holder > 0 else "another process"
            raise UsageError(
                f"--drop-failed: the spool {args.directory} is in use by {who}; close that "
                "publisher first (nothing was exported or dropped)"
            )
    exported = dropped = None
    last_seq: int | None = None
    summary = inspect(args.directory)  # SpoolError when it is no spool
    problems = check(args.directory) if args.check else None
    if args.export_failed:
        stream = open_failed_file(args.export_failed, flag="--export-failed")
        with stream:
            stream.truncate(0)
            exported = 0
            for entry in failed_entries(args.directory):
                stream.write(json.dumps(failed_record(entry), default=_json_default))
                stream.write("\n")
                exported += 1
                last_seq = entry.seq
    if args.drop_failed:
        if args.export_failed:
            dropped = _drop_failed(args.directory, up_to=last_seq) if last_seq is not None else 0
        else:
            dropped = _drop_failed(args.directory)
        summary = inspect(args.directory)
    if problems is None and summary.problems:  # met while counting: the counts stop there
        problems = list(summary.problems)
    if args.json:
        shown: dict[str, Any] = {
            "directory": summary.directory,
            "in_use_by": summary.in_use_by,
            "pending": summary.pending,
            "pending_bytes": summary.pending_bytes,
            "failed": summary.failed,
            "failed_bytes": summary.failed_bytes,
            "file_bytes": summary.file_bytes,
        }
        if exported is not None:
            shown["exported"] = exported
        if dropped is not None:
            shown["dropped"] = dropped
        if problems is not None:
            shown["problems"] = problems
        print(json.dumps(shown))
        return EXIT_NOT_CONFIRMED if problems else EXIT_OK
    out = sys.stdout
    use = (
        "not in use"
        if summary.in_use_by is None
        else f"in use by process {summary.in_use_by}"
        if summary.in_use_by > 0
        else "in use"
    )
    # what this run did first, then what the spool holds after it (the counts below are the
    # counts after any drop, so "failed 0" follows the line that says where they went)
    if exported is not None:
        print(
            f"{exported:,} failed messages written to {args.export_failed}; publish them again "
            f"with: reliable-amqp publish --format jsonl {args.export_failed}",
            file=out,
        )
    if dropped is not None:
        print(f"{dropped:,} failed messages dropped", file=out)
    print(f"spool {summary.directory} ({use})", file=out)
    print(
        f"  pending  {summary.pending:>12,} messages  {_size(summary.pending_bytes):>10}", file=out
    )
    print(f"  failed   {summary.failed:>12,} messages  {_size(summary.failed_bytes):>10}", file=out)
    print(f"  on disk  {'':>12}           {_size(summary.file_bytes):>10}", file=out)
    if problems is not None:
        for problem in problems:
            print(f"damaged: {problem}", file=out)
        print(f"check: {len(problems):,} problems" if problems else "check: no problems", file=out)
    return EXIT_NOT_CONFIRMED if problems else EXIT_OK


def failed_record(entry: FailedEntry) -> dict[str, Any]:
    """The JSON line of a failed message (``publish --format jsonl`` input; ``error`` is
    ignored there)."""
    message = entry.message
    record: dict[str, Any] = {}
    try:
        record["body"] = message.body.decode("utf-8")
    except UnicodeDecodeError:
        record["body"] = base64.b64encode(message.body).decode("ascii")
        record["body_encoding"] = "base64"
    record["exchange"] = message.exchange
    record["routing_key"] = message.routing_key
    record["mandatory"] = message.mandatory  # explicit: what reading it back defaults to varies
    record.update(set_properties(message))
    record[ERROR_FIELD] = {
        "type": "SpoolFailed",
        "reason": entry.reason,
        "failed_at": dt.datetime.fromtimestamp(entry.failed_at, dt.timezone.utc).isoformat(),
        "seq": entry.seq,
    }
    return record


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{count} B"


class SpoolRun:
    """``reliable-amqp publish --spool DIR``: what became of the messages the run found in the
    spool (recovered from an earlier run), for the summary and the exit code.

    Counted from the spool's own counts before and after the run: the recovered messages have
    no future. Of the run's own messages, those whose futures failed with ``PublisherClosed``
    stay in the spool (``own_kept``); every other outcome of its own removes them from it.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        try:
            before = inspect(directory)
        except SpoolError:  # none yet (or no spool: opening the publisher says what is wrong)
            self.recovered = self._failed_before = 0
        else:
            self.recovered, self._failed_before = before.pending, before.failed
        self.confirmed = self.failed = self.left = 0
        #: the run's own messages the spool keeps for the next run
        self.own_kept = 0

    def finish(self, own_kept: int) -> None:
        """After the publisher closed: count what became of the recovered messages."""
        self.own_kept = own_kept
        try:
            after = inspect(self.directory)
        except SpoolError:
            return
        self.failed = max(0, after.failed - self._failed_before)
        self.left = min(self.recovered - self.failed, max(0, after.pending - own_kept))
        self.confirmed = self.recovered - self.failed - self.left

    def exit_code(self, code: int) -> int:
        """The run's exit code, with what the recovered messages add (1: some failed)."""
        if code == EXIT_OK and self.failed:
            return EXIT_NOT_CONFIRMED
        return code

    def report_failed(self, stream: IO[str]) -> None:
        """Say where the recovered messages that failed are (stderr, even with --quiet)."""
        if self.failed:
            print(
                f"reliable-amqp: recovered from the spool and failed: {_count(self.failed)}, "
                "kept in its failed table with their reasons; see them with: reliable-amqp "
                f"spool {self.directory} --export-failed FILE",
                file=stream,
            )

    def summary(self, stream: IO[str]) -> None:
        """The summary's lines for what the spool keeps and for the recovered messages (after
        the run's own table)."""
        if self.own_kept:
            print(
                f"  {'in the spool':<14}{self.own_kept:>10,}   not confirmed yet: the next run "
                f"with --spool {self.directory} sends them",
                file=stream,
            )
        if not self.recovered:
            return
        print(f"{_count(self.recovered)} recovered from the spool {self.directory}", file=stream)
        print(f"  {'confirmed':<14}{self.confirmed:>10,}", file=stream)
        if self.failed:
            print(
                f"  {'failed':<14}{self.failed:>10,}   in the spool's failed table, with their "
                "reasons (reliable-amqp spool DIR --export-failed FILE)",
                file=stream,
            )
        if self.left:
            print(
                f"  {'in the spool':<14}{self.left:>10,}   not confirmed yet: the next run sends "
                "them",
                file=stream,
            )


def _count(count: int) -> str:
    return f"{count:,} message" if count == 1 else f"{count:,} messages"
