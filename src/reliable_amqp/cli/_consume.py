"""``reliable-amqp consume``: a queue's messages into a file, none acked before it is on disk.

``consume QUEUE --to FILE`` writes each message as one JSON line in the very format
``publish --format jsonl`` reads, and acknowledges a message only once its line is written,
flushed and synced to disk: lines are written a batch at a time, one ``fsync`` per batch, then
the whole batch is acked with one ``multiple`` ack. A batch that cannot be written is not acked
(the broker gives its messages back) and is cut off the file again.

It reads with a plain channel (``basic.consume``, ``--prefetch``, manual acks), not with
:class:`~reliable_amqp.Consumer`: a line that cannot be written is a reason to leave its message
where it is, not to retry it through a delay queue and dead-letter it; and ``--count N`` must
take exactly N. A lost connection ends the run (exit 3): what was not acked is the broker's again.
The line format (:func:`record`), the file (:class:`Sink`) and the connection are shared with
``dead-letters`` (``_dead_letters.py``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType
from typing import IO, Any

import pika
import pika.exceptions

from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.message import PROPERTY_ORDER
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._sync._pika import connection_parameters, translate_connection_error
from reliable_amqp.cli._io import _json_default, open_failed_file
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
    EXIT_INTERRUPTED,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    UsageError,
    add_connection_arguments,
    check_options,
    count_at_least_one,
    printable,
)

DEFAULT_PREFETCH = 500
DEFAULT_BATCH = 250
#: basic.qos carries the prefetch count in 16 bits
MAX_PREFETCH = 65_535


def add_consume_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``reliable-amqp consume``."""
    parser.add_argument("queue", metavar="QUEUE", help="the queue to consume from")
    parser.add_argument(
        "--to",
        required=True,
        metavar="FILE",
        help="append one JSON line per message to FILE (created 0600; the format "
        "`reliable-amqp publish --format jsonl FILE` reads)",
    )
    parser.add_argument(
        "--count", type=count_at_least_one, metavar="N", help="stop after N messages"
    )
    parser.add_argument(
        "--until-empty",
        action="store_true",
        help="stop once the queue has nothing ready and every message taken is written",
    )
    parser.add_argument(
        "--prefetch",
        type=count_at_least_one,
        default=DEFAULT_PREFETCH,
        metavar="N",
        help=f"unacknowledged messages at most (default {DEFAULT_PREFETCH})",
    )
    parser.add_argument(
        "--batch",
        type=count_at_least_one,
        default=DEFAULT_BATCH,
        metavar="N",
        help=f"lines written per fsync, at most (default {DEFAULT_BATCH}; at most --prefetch)",
    )
    add_connection_arguments(parser)


# --- one message as a JSON line ------------------------------------------------------------------


def record(
    body: bytes, exchange: str, routing_key: str, properties: pika.BasicProperties
) -> dict[str, Any]:
    """A delivered message as a ``publish --format jsonl`` line: body (UTF-8 text, else base64),
    exchange, routing key and every property it has set."""
    line: dict[str, Any] = {}
    try:
        line["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        line["body"] = base64.b64encode(body).decode("ascii")
        line["body_encoding"] = "base64"
    line["exchange"] = exchange
    line["routing_key"] = routing_key
    for name in PROPERTY_ORDER:
        value = getattr(properties, name, None)
        if value is not None:
            line[name] = value
    return line


def dumps(line: Mapping[str, Any]) -> str:
    """One JSON line; header values JSON has no type for (bytes, dates, decimals) as text."""
    return json.dumps(line, default=_json_default) + "\n"


class Sink:
    """The ``--to`` file: a batch of lines is written, flushed and synced, or cut off again."""

    def __init__(self, path: str) -> None:
        self.path = path
        stream: IO[str] = open_failed_file(path, "--to")
        self._stream = stream
        self._fd = stream.fileno()
        self._size = os.lseek(self._fd, 0, os.SEEK_END)  # appended to, never truncated
        self.written = 0
        # a file just created is not durable until its directory entry is: sync that once
        try:
            directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(directory)
        except OSError:
            pass  # some filesystems cannot sync a directory; the lines are still synced
        finally:
            os.close(directory)

    def write(self, lines: list[str]) -> None:
        """Write ``lines`` and sync them to disk; on failure, the file is as it was before."""
        data = "".join(lines).encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError:
            # a half-written batch would be lines of messages nobody acked: take them off
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)
        self.written += len(lines)

    def close(self) -> None:
        self._stream.close()


# --- connections ---------------------------------------------------------------------------------


def connect(options: PublisherOptions) -> pika.BlockingConnection:
    """A blocking connection to the first URL that answers, tried once each; else the last
    failure as the library's ``ReliableAmqpError`` (the caller exits 3)."""
    last: ReliableAmqpError | None = None
    for url in options.urls:
        params = connection_parameters(url, options)
        try:
            return pika.BlockingConnection(params)
        except (pika.exceptions.AMQPError, OSError) as exc:
            last = translate_connection_error(exc, params)
    assert last is not None
    raise last


class _Stop:
    """SIGINT and SIGTERM ask the loop to stop after the current batch (a second one exits at
    once: the broker gives back whatever was not acked)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    @contextmanager
    def installed(self) -> Iterator[_Stop]:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        try:
            yield self
        finally:
            for number, handler in self._previous.items():
                signal.signal(number, handler)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum


def problem(options: PublisherOptions, exc: BaseException) -> str:
    """``exc`` as one printable line naming the brokers (passwords shown as ``***``)."""
    urls = ", ".join(redact_url(u) for u in options.urls)
    return printable(f"{urls}: {type(exc).__name__}: {exc}")


# --- consume -------------------------------------------------------------------------------------


def run_consume(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp consume``; returns the exit code."""
    options = check_options(args)
    if args.prefetch > MAX_PREFETCH:  # before the file is created
        raise UsageError(f"--prefetch is at most {MAX_PREFETCH:,} (AMQP's prefetch count)")
    sink = Sink(args.to)
    stop = _Stop()
    try:
        with stop.installed():
            code = _consume(args, options, sink, stop)
    finally:
        sink.close()
    what = f"{sink.written:,} message{'' if sink.written == 1 else 's'}"
    print(f"{what} from {args.queue} written to {args.to}", file=sys.stderr)
    if code == EXIT_OK and stop.signal == signal.SIGINT:
        return EXIT_INTERRUPTED
    return code


def _consume(args: argparse.Namespace, options: PublisherOptions, sink: Sink, stop: _Stop) -> int:
    batch_size = min(args.batch, args.prefetch)  # more than the prefetch would never come
    try:
        connection = connect(options)
    except ReliableAmqpError as exc:
        print(f"reliable-amqp: cannot connect to {problem(options, exc)}", file=sys.stderr)
        return EXIT_CONNECTION
    lines: list[str] = []
    last_tag = 0
    taken = 0
    try:
        channel = connection.channel()
        # with --count, no more prefetched than will be taken: the rest would only be sent back
        prefetch = args.prefetch if args.count is None else min(args.prefetch, args.count)
        channel.basic_qos(prefetch_count=prefetch)
        channel.queue_declare(args.queue, passive=True)
        deliveries = channel.consume(args.queue, inactivity_timeout=0.2)

        def flush() -> None:
            nonlocal lines
            try:
                sink.write(lines)
            except OSError as exc:  # nothing of this batch is acked
                raise _WriteFailed(exc) from exc
            channel.basic_ack(last_tag, multiple=True)
            lines = []

        for method, properties, body in deliveries:
            if method is not None:
                lines.append(dumps(record(body, method.exchange, method.routing_key, properties)))
                last_tag = method.delivery_tag
                taken += 1
            done = args.count is not None and taken >= args.count
            if lines and (len(lines) >= batch_size or method is None or done or stop.signal):
                flush()
            if done or stop.signal:
                break
            if (
                method is None
                and args.until_empty
                and channel.queue_declare(args.queue, passive=True).method.message_count == 0
            ):
                break
        else:
            # pika's generator ends when the broker cancels the subscription (the queue was
            # deleted, say): what was taken is written (a deleted queue kept nothing of it),
            # and the run fails loudly rather than ending as if done
            if lines:
                flush()
            close(connection)
            print(
                f"reliable-amqp: the broker cancelled the subscription to {args.queue!r} "
                "(was the queue deleted?)",
                file=sys.stderr,
            )
            return EXIT_CONNECTION
        channel.cancel()  # what was prefetched and not taken goes back to the queue
        connection.close()
    except _WriteFailed as exc:
        error = exc.error
        print(
            f"reliable-amqp: cannot write {args.to}: {error.strerror or error}; the "
            f"{len(lines):,} messages of that batch were not acked and stay in the queue",
            file=sys.stderr,
        )
        close(connection)
        return EXIT_NOT_CONFIRMED
    except pika.exceptions.ChannelClosedByBroker as exc:
        close(connection)
        if exc.reply_code == 404:
            raise UsageError(f"no queue {args.queue!r}: {printable(exc.reply_text)}") from None
        print(f"reliable-amqp: the broker closed the channel: {printable(exc)}", file=sys.stderr)
        return EXIT_CONNECTION
    except (pika.exceptions.AMQPError, ReliableAmqpError) as exc:
        print(f"reliable-amqp: connection lost: {problem(options, exc)}", file=sys.stderr)
        close(connection)
        return EXIT_CONNECTION
    except KeyboardInterrupt:  # the second Ctrl-C: what is not acked goes back to the queue
        close(connection)
        return EXIT_INTERRUPTED
    return EXIT_OK


class _WriteFailed(Exception):
    """The ``--to`` file could not take a batch (kept apart from the connection's OSErrors)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def close(connection: pika.BlockingConnection) -> None:
    """Close ``connection`` if it is open; a failure to close is no news (it is gone)."""
    try:
        if connection.is_open:
            connection.close()
    except (pika.exceptions.AMQPError, OSError):
        pass


#: the sub-command of this module, for ``build_parser(more=...)``
CONSUME_COMMANDS = (
    (
        "consume",
        "write a queue's messages to a file of JSON lines, each acked once written and synced",
        "Consume QUEUE into FILE, one JSON line per message (the input format of\n"
        "`publish --format jsonl`). A message is acked only once its line is on disk.\n"
        "Runs until --count, --until-empty, Ctrl-C or SIGTERM.",
        add_consume_arguments,
    ),
)
