"""``reliable-amqp dead-letters``: see, export and requeue what a consumer gave up on.

``dead-letters QUEUE`` lists what ``QUEUE.dead`` holds (the reason, exception type and attempts
:class:`~reliable_amqp.Consumer` put in its headers) without taking anything away: it reads with
``basic.get`` and no ack, and closing the channel gives everything back. ``--export FILE`` writes
the same as JSON lines (``publish --format jsonl`` input, addressed to the original queue);
``--requeue`` moves each one back to its queue, acked only after the broker confirmed its
republish (through :class:`~reliable_amqp.Publisher`): a failed republish leaves it a dead
letter.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from concurrent.futures import wait
from typing import Any

import pika
import pika.exceptions

from reliable_amqp._core.errors import PublishError, ReliableAmqpError
from reliable_amqp._core.message import PROPERTY_ORDER
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp._core.redelivery import ATTEMPT_HEADER, BROKER_HEADERS, DEAD_HEADERS
from reliable_amqp._sync.publisher import Publisher
from reliable_amqp.cli._consume import DEFAULT_BATCH, Sink, close, connect, dumps, problem, record
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
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
DEAD_LETTER_HEADERS = frozenset((*DEAD_HEADERS, ATTEMPT_HEADER, *BROKER_HEADERS))


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


def run_dead_letters(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp dead-letters``; returns the exit code."""
    options = check_options(args)
    dead = args.dead_letter_queue or f"{args.queue}.dead"
    export = Sink(args.export) if args.export else None
    try:
        connection = connect(options)
    except ReliableAmqpError as exc:
        if export is not None:
            export.close()
        print(f"reliable-amqp: cannot connect to {problem(options, exc)}", file=sys.stderr)
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
        print(f"reliable-amqp: connection lost: {problem(options, exc)}", file=sys.stderr)
        close(connection)
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


#: the sub-command of this module, for ``build_parser(more=...)``
DEAD_LETTERS_COMMANDS = (
    (
        "dead-letters",
        "show, export or requeue the dead letters of a queue (QUEUE.dead)",
        "List the dead letters of QUEUE with their reason; --export them as JSON lines;\n"
        "--requeue moves them back, each removed only once its republish is confirmed.",
        add_dead_letters_arguments,
    ),
)
