"""``reliable-amqp consume`` and ``reliable-amqp dead-letters``: messages out of a queue, none lost.

``consume QUEUE --to FILE`` writes each message as one JSON line in the very format
``publish --format jsonl`` reads, and acknowledges a message only once its line is written,
flushed and synced to disk: lines are written a batch at a time, one ``fsync`` per batch, then
the whole batch is acked with one ``multiple`` ack. A batch that cannot be written is not acked
(the broker gives its messages back) and is cut off the file again.

It reads with a plain channel (``basic.consume``, ``--prefetch``, manual acks), not with
:class:`~reliable_amqp.Consumer`: a line that cannot be written is a reason to leave its message
where it is, not to retry it through a delay queue and dead-letter it; and ``--count N`` must
take exactly N. A lost connection ends the run (exit 3): what was not acked is the broker's again.

``dead-letters QUEUE`` lists what ``QUEUE.dead`` holds (the reason, exception type and attempts
the consumer put in its headers) without taking anything away; ``--export FILE`` writes the same
as JSON lines; ``--requeue`` moves each one back to its queue, acked only after the broker
confirmed its republish (through :class:`~reliable_amqp.Publisher`).
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
from concurrent.futures import wait
from contextlib import contextmanager
from types import FrameType
from typing import IO, Any

import pika
import pika.exceptions

from reliable_amqp._core.errors import PublishError, ReliableAmqpError
from reliable_amqp._core.message import PROPERTY_ORDER
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._sync._pika import connection_parameters, translate_connection_error
from reliable_amqp._sync.publisher import Publisher
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

#: dropped on --requeue, for a fresh start: the headers the consumer puts on a dead letter and
#: its attempt header (``_core/redelivery.py``), and those the broker adds when it delivers or
#: dead-letters (a carried ``x-delivery-count`` would count the old copy's deliveries again)
DEAD_LETTER_HEADERS = frozenset(
    {
        "x-death-reason",
        "x-exception-type",
        "x-attempts",
        "x-original-queue",
        "x-original-exchange",
        "x-original-routing-key",
        "x-consume-attempt",
        "x-delivery-count",
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)
DEFAULT_PREFETCH = 500
DEFAULT_BATCH = 250


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


def add_dead_letters_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``reliable-amqp dead-letters``."""
    parser.add_argument("queue", metavar="QUEUE", help="the queue whose dead letters to show")
    parser.add_argument(
        "--dead-letter-queue",
        metavar="NAME",
        help="where the dead letters are (default: QUEUE.dead)",
    )
    parser.add_argument(
        "--export",
        metavar="FILE",
        help="write them to FILE as JSON lines (created 0600), addressed to their queue; they "
        "stay dead letters",
    )
    parser.add_argument(
        "--requeue",
        action="store_true",
        help="move them back to their queue (x-original-queue, else QUEUE), each removed only "
        "after the broker confirmed its republish",
    )
    parser.add_argument(
        "--count", type=count_at_least_one, metavar="N", help="the first N dead letters only"
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


def _connect(options: PublisherOptions) -> pika.BlockingConnection:
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


def _problem(options: PublisherOptions, exc: BaseException) -> str:
    urls = ", ".join(redact_url(u) for u in options.urls)
    return printable(f"{urls}: {type(exc).__name__}: {exc}")


# --- consume -------------------------------------------------------------------------------------


def run_consume(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp consume``; returns the exit code."""
    options = check_options(args)
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
        connection = _connect(options)
    except ReliableAmqpError as exc:
        print(f"reliable-amqp: cannot connect to {_problem(options, exc)}", file=sys.stderr)
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
            _close(connection)
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
        _close(connection)
        return EXIT_NOT_CONFIRMED
    except pika.exceptions.ChannelClosedByBroker as exc:
        _close(connection)
        if exc.reply_code == 404:
            raise UsageError(f"no queue {args.queue!r}: {printable(exc.reply_text)}") from None
        print(f"reliable-amqp: the broker closed the channel: {printable(exc)}", file=sys.stderr)
        return EXIT_CONNECTION
    except (pika.exceptions.AMQPError, ReliableAmqpError) as exc:
        print(f"reliable-amqp: connection lost: {_problem(options, exc)}", file=sys.stderr)
        _close(connection)
        return EXIT_CONNECTION
    except KeyboardInterrupt:  # the second Ctrl-C: what is not acked goes back to the queue
        _close(connection)
        return EXIT_INTERRUPTED
    return EXIT_OK


class _WriteFailed(Exception):
    """The ``--to`` file could not take a batch (kept apart from the connection's OSErrors)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _close(connection: pika.BlockingConnection) -> None:
    try:
        if connection.is_open:
            connection.close()
    except (pika.exceptions.AMQPError, OSError):
        pass


# --- dead-letters --------------------------------------------------------------------------------


def run_dead_letters(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp dead-letters``; returns the exit code."""
    options = check_options(args)
    dead = args.dead_letter_queue or f"{args.queue}.dead"
    export = Sink(args.export) if args.export else None
    try:
        connection = _connect(options)
    except ReliableAmqpError as exc:
        if export is not None:
            export.close()
        print(f"reliable-amqp: cannot connect to {_problem(options, exc)}", file=sys.stderr)
        return EXIT_CONNECTION
    try:
        channel = connection.channel()
        try:
            total = channel.queue_declare(dead, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                raise UsageError(f"no dead-letter queue {dead!r}") from None
            raise
        if args.requeue:
            return _requeue(args, options, channel, dead, export)
        shown = 0
        print(f"{total:,} dead letter{'' if total == 1 else 's'} in {dead}")
        while args.count is None or shown < args.count:
            # basic.get without an ack: every one is seen once, and all of them go back to the
            # queue, in their order, when the channel closes
            method, properties, body = channel.basic_get(dead, auto_ack=False)
            if method is None:
                break
            shown += 1
            print(_describe(properties, args.queue))
            if export is not None:
                export.write([dumps(record(body, "", _origin(properties, args.queue), properties))])
        connection.close()
    except (pika.exceptions.AMQPError, ReliableAmqpError) as exc:
        print(f"reliable-amqp: connection lost: {_problem(options, exc)}", file=sys.stderr)
        _close(connection)
        return EXIT_CONNECTION
    finally:
        if export is not None:
            export.close()
    if export is not None:
        print(f"{export.written:,} written to {args.export}")
    # as `outbox failed` and `spool`: dead letters found and left where they are are worth a
    # non-zero exit (a script or a check can tell "there are some" without parsing)
    return EXIT_NOT_CONFIRMED if total else EXIT_OK


def _headers(properties: pika.BasicProperties) -> dict[str, Any]:
    headers = properties.headers
    return dict(headers) if isinstance(headers, Mapping) else {}


def _origin(properties: pika.BasicProperties, queue: str) -> str:
    original = _headers(properties).get("x-original-queue")
    if isinstance(original, bytes):
        original = original.decode("utf-8", "replace")
    return original if isinstance(original, str) and original else queue


def _describe(properties: pika.BasicProperties, queue: str) -> str:
    """One dead letter on one line: id, attempts, exception and reason, where it came from."""
    headers = _headers(properties)

    def text(name: str, default: str = "?") -> str:
        value = headers.get(name)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        return printable(default if value is None else value)

    kind = text("x-exception-type", "")
    reason = text("x-death-reason")
    return (
        f"  {_id(properties)}  attempts {text('x-attempts')}  "
        f"{kind + ': ' if kind else ''}{reason}  (from {printable(_origin(properties, queue))})"
    )


def _requeue(
    args: argparse.Namespace,
    options: PublisherOptions,
    channel: Any,
    dead: str,
    export: Sink | None,
) -> int:
    moved = 0
    failed: list[str] = []
    with Publisher(list(options.urls), **options.kwargs()) as publisher:
        while args.count is None or moved + len(failed) < args.count:
            batch = []
            room = DEFAULT_BATCH if args.count is None else args.count - moved - len(failed)
            for _ in range(min(DEFAULT_BATCH, room)):
                method, properties, body = channel.basic_get(dead, auto_ack=False)
                if method is None:
                    break
                batch.append((method.delivery_tag, properties, body))
            if not batch:
                break
            if export is not None:  # written (and synced) before anything moves
                export.write([dumps(record(b, "", _origin(p, args.queue), p)) for _, p, b in batch])
            futures = []
            for tag, properties, body in batch:
                target = _origin(properties, args.queue)
                if target == dead:  # it would come round again, and again
                    failed.append(f"{_id(properties)}: its x-original-queue is {dead} itself")
                    continue
                kwargs = _publish_properties(properties)
                futures.append((tag, properties, publisher.publish("", target, body, **kwargs)))
            # the reading connection's heartbeats go on while the confirms come
            pending = [future for _, _, future in futures]
            while wait(pending, timeout=0.05).not_done:
                channel.connection.process_data_events(time_limit=0)
            for tag, properties, future in futures:
                try:
                    future.result()
                except PublishError as exc:  # not acked: it stays a dead letter
                    failed.append(f"{_id(properties)}: {printable(exc)}")
                    continue
                channel.basic_ack(tag)
                moved += 1
    channel.connection.close()
    print(f"{moved:,} dead letter{'' if moved == 1 else 's'} moved back from {dead}")
    for line in failed[:20]:
        print(f"  not moved: {line}", file=sys.stderr)
    if failed:
        print(f"reliable-amqp: {len(failed):,} stay in {dead}", file=sys.stderr)
        return EXIT_NOT_CONFIRMED
    return EXIT_OK


def _id(properties: pika.BasicProperties) -> str:
    return printable(properties.message_id or "-")


def _publish_properties(properties: pika.BasicProperties) -> dict[str, Any]:
    """The message's properties for ``publish()``, without what the dead-lettering added."""
    kwargs: dict[str, Any] = {}
    for name in PROPERTY_ORDER:
        value = getattr(properties, name, None)
        if value is not None:
            kwargs[name] = value
    headers = {k: v for k, v in _headers(properties).items() if k not in DEAD_LETTER_HEADERS}
    if headers:
        kwargs["headers"] = headers
    else:
        kwargs.pop("headers", None)
    return kwargs


#: the sub-commands of this module, for ``build_parser(more=...)``
CONSUME_COMMANDS = (
    (
        "consume",
        "write a queue's messages to a file of JSON lines, each acked once written and synced",
        "Consume QUEUE into FILE, one JSON line per message (the input format of\n"
        "`publish --format jsonl`). A message is acked only once its line is on disk.\n"
        "Runs until --count, --until-empty, Ctrl-C or SIGTERM.",
        add_consume_arguments,
    ),
    (
        "dead-letters",
        "show, export or requeue the dead letters of a queue (QUEUE.dead)",
        "List the dead letters of QUEUE with their reason; --export them as JSON lines;\n"
        "--requeue moves them back, each removed only once its republish is confirmed.",
        add_dead_letters_arguments,
    ),
)
