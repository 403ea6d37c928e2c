"""Input and output of ``reliable-amqp publish``: messages in, failed messages out, progress.

The whole input is parsed and every message validated (with the same checks ``publish()`` makes)
before anything is sent, so a bad line N is reported as such and nothing is half-published.
Failed messages are written as JSON lines in the very format :func:`read_messages` accepts, with
their message ids, so a replay is recognisable as a duplicate by consumers that deduplicate.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import IO, Any

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.errors import InvalidMessage, PublishError
from reliable_amqp._core.message import PROPERTY_NAMES, OutgoingMessage
from reliable_amqp._core.stats import EventKind, PublisherEvent
from reliable_amqp.cli._parse import UsageError, printable

#: Fields of a JSON line besides the AMQP properties.
MESSAGE_FIELDS = frozenset({"body", "body_encoding", "exchange", "routing_key", "mandatory"})
#: Written by ``--failed`` next to each message; ignored on input so a failed file replays as is.
ERROR_FIELD = "error"
KNOWN_FIELDS = MESSAGE_FIELDS | PROPERTY_NAMES | {ERROR_FIELD}
BODY_ENCODINGS = ("utf-8", "base64")
MAX_REPORTED_ERRORS = 10


@dataclass(frozen=True)
class Defaults:
    """What applies to every message unless its JSON line says otherwise."""

    exchange: str = ""
    routing_key: str | None = None
    mandatory: bool = True
    properties: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Item:
    """One validated message and the input line it came from."""

    line: int
    message: OutgoingMessage


class InputError(Exception):
    """The input is not valid; ``problems`` are ``(line, text)`` pairs, in input order."""

    def __init__(self, source: str, problems: list[tuple[int, str]], total: int) -> None:
        self.source = source
        self.problems = problems
        self.total = total
        shown = [f"{source}: line {line}: {text}" for line, text in problems]
        if total > len(problems):
            shown.append(f"... and {total - len(problems)} more bad lines")
        super().__init__("\n".join(shown))


def read_messages(stream: IO[bytes], source: str, fmt: str, defaults: Defaults) -> list[Item]:
    """Every message of ``stream``, validated; raises :class:`InputError` naming bad lines.

    ``fmt`` is ``"lines"`` (each line is a body) or ``"jsonl"`` (each line a JSON object). Empty
    lines are skipped in both formats.
    """
    items: list[Item] = []
    problems: list[tuple[int, str]] = []
    bad = 0
    for number, raw in enumerate(stream, start=1):
        line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw
        empty = not line.strip() if fmt == "jsonl" else not line
        if empty:
            continue
        try:
            if fmt == "jsonl":
                message = _from_json_line(line, defaults)
            else:
                message = _build(
                    defaults.exchange,
                    defaults.routing_key,
                    line,
                    defaults.mandatory,
                    dict(defaults.properties),
                )
        except _LineError as exc:
            bad += 1
            if len(problems) < MAX_REPORTED_ERRORS:
                problems.append((number, str(exc)))
            continue
        items.append(Item(number, message))
    if bad:
        raise InputError(source, problems, bad)
    return items


class _LineError(Exception):
    """What is wrong with one line (the caller adds the line number)."""


def _from_json_line(line: bytes, defaults: Defaults) -> OutgoingMessage:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _LineError(f"not UTF-8 text (byte {exc.start + 1})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _LineError(f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(record, dict):
        raise _LineError(f"expected a JSON object, got {_json_type(record)}")
    unknown = sorted(set(record) - KNOWN_FIELDS)
    if unknown:
        raise _LineError(f"unknown field {unknown[0]!r} (known: {', '.join(sorted(KNOWN_FIELDS))})")
    if "body" not in record:
        raise _LineError("missing field 'body'")
    body = _decode_body(record["body"], record.get("body_encoding", "utf-8"))
    properties = dict(defaults.properties)
    for name in PROPERTY_NAMES & set(record):
        properties[name] = record[name]
    default_headers = defaults.properties.get("headers")
    if isinstance(default_headers, Mapping) and isinstance(record.get("headers"), dict):
        properties["headers"] = {**default_headers, **record["headers"]}
    if "timestamp" in properties:
        properties["timestamp"] = _timestamp(properties["timestamp"])
    mandatory = record.get("mandatory", defaults.mandatory)
    if not isinstance(mandatory, bool):
        raise _LineError(f"invalid mandatory: must be true or false, not {_json_type(mandatory)}")
    return _build(
        record.get("exchange", defaults.exchange),
        record.get("routing_key", defaults.routing_key),
        body,
        mandatory,
        properties,
    )


def _build(
    exchange: object,
    routing_key: object,
    body: bytes,
    mandatory: bool,
    properties: dict[str, Any],
) -> OutgoingMessage:
    if routing_key is None:
        raise _LineError(
            "no routing key: give the line a routing_key, or pass --routing-key "
            "(or --declare-queue to publish to that queue)"
        )
    try:
        return build_message(
            exchange, routing_key, body, mandatory=mandatory, properties=properties
        )
    except InvalidMessage as exc:
        raise _LineError(str(exc)) from None


def _decode_body(body: object, encoding: object) -> bytes:
    if not isinstance(body, str):
        raise _LineError(
            f"invalid body: must be a JSON string, not {_json_type(body)} "
            '(use body_encoding "base64" for binary bodies)'
        )
    if encoding == "utf-8":
        return body.encode("utf-8", "surrogatepass")
    if encoding == "base64":
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise _LineError("invalid body: not valid base64") from None
    raise _LineError(f"invalid body_encoding {encoding!r} (use {' or '.join(BODY_ENCODINGS)})")


def _timestamp(value: object) -> object:
    # JSON has no dates: POSIX seconds, or an ISO 8601 string (UTC unless it says otherwise).
    if isinstance(value, str):
        try:
            return dt.datetime.fromisoformat(value)
        except ValueError:
            raise _LineError(
                f"invalid timestamp: {value!r} is neither POSIX seconds nor an ISO 8601 date"
            ) from None
    return value


def _json_type(value: object) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


# --- failed messages ----------------------------------------------------------------------------


def failure_record(item: Item, error: BaseException | str) -> dict[str, Any]:
    """The JSON line for a message that was not confirmed (``publish --format jsonl`` input)."""
    message = item.message
    record: dict[str, Any] = {}
    try:
        record["body"] = message.body.decode("utf-8")
    except UnicodeDecodeError:
        record["body"] = base64.b64encode(message.body).decode("ascii")
        record["body_encoding"] = "base64"
    record["exchange"] = message.exchange
    record["routing_key"] = message.routing_key
    if message.mandatory:
        record["mandatory"] = True
    record.update(set_properties(message))
    if isinstance(error, PublishError):
        detail = {"type": type(error).__name__, "reason": str(error), "attempts": error.attempts}
    else:
        detail = {"type": "NotPublished", "reason": str(error), "attempts": 0}
    record[ERROR_FIELD] = {**detail, "line": item.line}
    return record


def write_failures(stream: IO[str], failures: Iterable[tuple[Item, BaseException | str]]) -> int:
    """Write one JSON line per failed message; returns how many were written."""
    written = 0
    for item, error in failures:
        stream.write(json.dumps(failure_record(item, error), default=_json_default))
        stream.write("\n")
        written += 1
    stream.flush()
    return written


def _json_default(value: object) -> object:
    # Headers that came from JSON are JSON again; anything else (bytes, Decimal, datetime from a
    # future input path) is kept readable rather than lost.
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


# --- progress -----------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar with the confirmed rate, drawn only on a terminal."""

    def __init__(self, total: int, stream: IO[str], enabled: bool) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled and total > 0
        self.started = time.monotonic()
        self._drawn = 0.0
        #: shown after the counts while it is set (the publisher reconnecting, say)
        self.note = ""

    def update(self, confirmed: int, failed: int, *, force: bool = False) -> None:
        """Redraw (at most ten times a second unless ``force``)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn < 0.1:
            return
        self._drawn = now
        elapsed = max(now - self.started, 1e-6)
        done = confirmed + failed
        width = max(10, min(40, columns(self.stream) - 60))
        filled = int(width * done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        text = f"\r[{bar}] {confirmed:,}/{self.total:,} confirmed  {confirmed / elapsed:,.0f} msg/s"
        if failed:
            text += f"  {failed:,} failed"
        if self.note:
            text += f"  {self.note}"
        # one terminal line at most: a wrapped line would not be redrawn in place by "\r"
        self.stream.write(text[: columns(self.stream)] + "\033[K")
        self.stream.flush()

    @property
    def drawn(self) -> bool:
        """True once the bar was drawn (it owns the terminal's last line from then on)."""
        return self._drawn > 0

    def finish(self, confirmed: int, failed: int) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self.update(confirmed, failed, force=True)
            self.stream.write("\n")
            self.stream.flush()


def set_properties(message: OutgoingMessage) -> dict[str, Any]:
    """The properties ``message`` sets (the ones not None), as ``publish()`` keywords."""
    props = message.properties
    return {f.name: value for f in fields(props) if (value := getattr(props, f.name)) is not None}


def columns(stream: IO[str]) -> int:
    """The width of the terminal ``stream`` draws on (else $COLUMNS, else 80)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((80, 20)).columns


class RetryStatus:
    """On a terminal, that the publisher is retrying a connection (the cause, attempt n of m,
    next in x s): one line that the next attempt replaces and that is cleared once connected or
    given up, so the final error is the only one left; while the progress bar is drawn, a note
    on the bar instead. An ``on_event`` hook: runs on the publisher's I/O thread."""

    def __init__(
        self,
        stream: IO[str],
        progress: Progress,
        max_attempts: int | None,
        *,
        draw: bool = True,
    ) -> None:
        self.stream = stream
        self.progress = progress
        self.max_attempts = max_attempts
        #: False: nothing is drawn (not a terminal, --quiet, -v), what happened is still kept
        self.draw = draw
        #: why the publisher gave up connecting (RECOVERY_FAILED), if it did
        self.gave_up: BaseException | None = None
        #: a connection opened at least once
        self.connected = False
        self._lock = threading.Lock()
        self._shown = False  # a status line is on the terminal
        self._lost = False  # a connection was open and is lost (not just failing to connect)
        #: RETRYING events seen (attempts after the first)
        self.retries = 0

    def on_event(self, event: PublisherEvent) -> None:
        """The publisher's ``on_event`` hook."""
        kind = event.kind
        if kind is EventKind.RECOVERY_FAILED:
            self.gave_up = event.error
        elif kind is EventKind.CONNECTED:
            self.connected = True
        if not self.draw:
            return
        if kind is EventKind.CONNECTION_LOST:
            self._lost = True
        elif kind is EventKind.RETRYING:
            self.retries += 1
            of = f" of {self.max_attempts}" if self.max_attempts else ""
            delay = event.delay or 0.0
            what = "reconnecting" if self._lost else "retrying"
            cause = printable(event.error if event.error is not None else event.detail)
            note = f"{what}: attempt {event.attempt}{of}, next in {delay:.1f} s"
            if self.progress.drawn:
                self.progress.note = f"({note}; {cause})"  # the attempt first: it may be cut
                return
            line = f"reliable-amqp: {cause}; {note}"
            if len(line) >= (width := columns(self.stream)):
                # one terminal line at most (a wrapped one is not replaced in place): the
                # attempt first, then as much of the cause as fits
                line = f"reliable-amqp: {note}; {cause}"[: width - 1]
            with self._lock:
                self.stream.write(f"\r{line}\033[K")
                self.stream.flush()
                self._shown = True
        elif kind in (EventKind.CONNECTED, EventKind.RECOVERED):
            self._lost = False
            self.progress.note = ""
            self.clear()
        elif kind in (EventKind.RECOVERY_FAILED, EventKind.CLOSED):
            self.progress.note = ""
            self.clear()

    def clear(self) -> None:
        """Take the status line (or the progress bar: finish() draws it again) off the
        terminal, before anything else is written there."""
        with self._lock:
            if self._shown or (self.draw and self.progress.drawn):
                self.stream.write("\r\033[K")
                self.stream.flush()
                self._shown = False


def open_failed_file(path: str, flag: str = "--failed") -> IO[str]:
    """Open ``--failed PATH`` (or ``flag``'s file) for writing: created 0600, never through a
    symlink (truncated only when the failures are written).

    Failed messages are message bodies: they get the permissions of a private file. An existing
    file is made 0600 as well. ``O_NOFOLLOW`` refuses a symbolic link planted at ``PATH``
    (which could point the write at any file the user may write).
    """
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        if os.path.islink(path):
            raise UsageError(f"refusing to write {flag} {path}: it is a symbolic link")
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            raise UsageError(f"refusing to write {flag} {path}: it is a symbolic link") from None
        raise UsageError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"refusing to write {flag} {path}: not a regular file")
        os.fchmod(fd, 0o600)
        # truncated when written, after publishing: a run stopped before that leaves it as it was
        return os.fdopen(fd, "w", encoding="utf-8")
    except BaseException:
        os.close(fd)
        raise
