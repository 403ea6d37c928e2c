"""``reliable-amqp bench``: the comparison that motivates streaming publisher confirms.

Four ways to publish the same persistent messages to the same durable queue, on the user's own
broker: a transaction per message, one confirm wait per message (pika's
``BlockingChannel.confirm_delivery``), streaming confirms (this library's :class:`Publisher`) and
no confirms at all. Each is timed from the first publish until the broker has every message (the
confirm, the commit, or for "no confirms" a synchronous round trip after the last publish, which
the broker answers only once it has routed everything before it). The queue is emptied between
modes and deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import pika
import pika.exceptions

from reliable_amqp._core.errors import ReliableAmqpError
from reliable_amqp._core.message import Confirmation
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._sync._pika import connection_parameters, translate_connection_error
from reliable_amqp._sync.publisher import Publisher
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    UsageError,
    add_connection_arguments,
    check_options,
    count,
    count_at_least_one,
    printable,
)

#: mode -> what it does, in the order they run (slowest first).
MODES: dict[str, str] = {
    "transactions": "a transaction per message (tx.select, publish, tx.commit)",
    "confirm-each": "one confirm wait per message (pika confirm_delivery)",
    "streaming": "streaming confirms (reliable_amqp.Publisher)",
    "streaming-many": "streaming confirms, 1,000 bodies a publish_many() call",
    "no-confirms": "no confirms (pika basic_publish): nothing says what arrived",
}
#: the modes that wait for the broker once per message
SLOW_MODES = frozenset({"transactions", "confirm-each"})


@dataclass(frozen=True)
class Result:
    """One mode's measurement."""

    mode: str
    description: str
    messages: int
    seconds: float
    rate: float  # messages per second
    ratio: float  # rate / rate of the fastest mode
    queued: int  # messages in the queue afterwards (should equal ``messages``)
    #: client CPU per message in microseconds (this process, every thread, while timed)
    cpu_us: float


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``reliable-amqp bench``."""
    parser.add_argument(
        "--count", type=count_at_least_one, default=10_000, help="messages per mode (default 10000)"
    )
    parser.add_argument(
        "--slow-count",
        type=count_at_least_one,
        default=1_000,
        help="messages for the two modes that wait once per message, at most --count "
        "(default 1000: they run 10 to 100 times slower; rates stay comparable)",
    )
    parser.add_argument(
        "--body-size", type=count, default=256, help="body size in bytes (default 256)"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated modes to run (default: all of {', '.join(MODES)})",
    )
    parser.add_argument(
        "--queue",
        metavar="NAME",
        help="name of the queue to create (default: reliable-amqp-bench-<random>); it must not "
        "exist yet, since it is deleted at the end",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_connection_arguments(parser)


def run_bench(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp bench``; returns the exit code."""
    options = check_options(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UsageError(
            f"unknown mode {unknown[0] if unknown else '(none)'!r} in --modes "
            f"(known: {', '.join(MODES)})"
        )
    url = options.urls[0]
    shown = redact_url(url)
    queue = args.queue or f"reliable-amqp-bench-{uuid.uuid4().hex[:12]}"
    body = b"x" * args.body_size
    parameters = _parameters(url, options)
    try:
        connection = pika.BlockingConnection(parameters)
    except (pika.exceptions.AMQPError, OSError) as exc:
        problem = printable(translate_connection_error(exc, parameters))  # names host:port
        print(f"reliable-amqp: cannot connect to {shown}: {problem}", file=sys.stderr)
        return EXIT_CONNECTION
    if _queue_exists(connection, queue):
        connection.close()
        raise UsageError(f"queue {queue!r} exists already; bench deletes its queue at the end")
    measured: list[tuple[str, int, tuple[float, float], int]] = []
    try:
        admin = connection.channel()
        admin.queue_declare(queue, durable=True)
        for mode in MODES:
            if mode not in modes:
                continue
            n = min(args.count, args.slow_count) if mode in SLOW_MODES else args.count
            if not args.json:
                print(f"  {mode}: {n:,} messages ...", file=sys.stderr, flush=True)
            seconds, cpu = RUNNERS[mode](connection, options, queue, body, n)
            queued = _queued(admin, queue, n)
            measured.append((mode, n, (seconds, cpu), queued))
            admin.queue_purge(queue)
    except (pika.exceptions.AMQPError, ReliableAmqpError, OSError) as exc:
        print(
            f"reliable-amqp: benchmark against {shown} failed: {type(exc).__name__} "
            f"{printable(exc)}",
            file=sys.stderr,
        )
        return EXIT_CONNECTION
    finally:
        _delete_queue(connection, queue)
    results = _results(measured)
    if args.json:
        report = {
            "broker": shown,
            "queue": queue,
            "body_size": args.body_size,
            "persistent": True,
            "results": [asdict(r) for r in results],
        }
        print(json.dumps(report, indent=2))
    else:
        _table(results, shown, args.body_size)
    short = [r for r in results if r.queued != r.messages and r.mode != "no-confirms"]
    for r in short:
        print(
            f"reliable-amqp: {r.mode}: {r.queued} of {r.messages} messages reached the queue",
            file=sys.stderr,
        )
    return EXIT_NOT_CONFIRMED if short else EXIT_OK


def _parameters(url: str, options: PublisherOptions) -> pika.URLParameters:
    # the publisher's parameters: TLS, credentials and heartbeat from the options
    params = connection_parameters(url, options)
    params.socket_timeout = options.connect_timeout
    params.blocked_connection_timeout = options.delivery_timeout
    return params


def _queued(admin: Any, queue: str, expected: int, patience: float = 5.0) -> int:
    """How many messages the queue holds, once it holds ``expected`` or ``patience`` seconds
    passed (untimed). The queue counts a routed message when it has taken it in, which can come
    a little after the broker answered the publisher's round trip (no-confirms mode)."""
    end = time.monotonic() + patience
    while True:
        queued = int(admin.queue_declare(queue, passive=True).method.message_count)
        if queued >= expected or time.monotonic() >= end:
            return queued
        time.sleep(0.02)


def _queue_exists(connection: Any, queue: str) -> bool:
    try:
        channel = connection.channel()
        channel.queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return False
        raise
    channel.close()
    return True


def _delete_queue(connection: Any, queue: str) -> None:
    try:
        if connection.is_open:
            connection.channel().queue_delete(queue)
            connection.close()
    except (pika.exceptions.AMQPError, OSError):
        print(f"reliable-amqp: could not delete benchmark queue {queue!r}", file=sys.stderr)


def _results(measured: list[tuple[str, int, tuple[float, float], int]]) -> list[Result]:
    rates = [count / max(seconds, 1e-9) for _, count, (seconds, _), _ in measured]
    fastest = max(rates, default=1.0)
    return [
        Result(
            mode,
            MODES[mode],
            count,
            round(seconds, 4),
            round(rate, 1),
            round(rate / fastest, 4),
            queued,
            round(cpu / count * 1e6, 2),
        )
        for (mode, count, (seconds, cpu), queued), rate in zip(measured, rates, strict=True)
    ]


def _table(results: list[Result], broker: str, body_size: int) -> None:
    print(f"broker {broker}: persistent messages of {body_size} bytes to a durable queue")
    header = (
        f"{'mode':<16}{'messages':>10}{'seconds':>10}{'msgs/s':>11}{'vs fastest':>12}"
        f"{'client CPU':>12}  how"
    )
    print(header)
    for r in results:
        print(
            f"{r.mode:<16}{r.messages:>10,}{r.seconds:>10.2f}{r.rate:>11,.0f}"
            f"{r.ratio:>11.3f}x{r.cpu_us:>9.1f} us  {r.description}"
        )
    print(
        "client CPU: this process's CPU time per message while timed (all threads); where the "
        "broker is not the limit, one process publishes at most 1 / (client CPU) msgs/s"
    )


# --- the four ways to publish -----------------------------------------------------------------

_PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _transactions(
    connection: Any, options: PublisherOptions, queue: str, body: bytes, count: int
) -> tuple[float, float]:
    channel = connection.channel()
    channel.tx_select()
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        channel.basic_publish("", queue, body, _PERSISTENT)
        channel.tx_commit()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    channel.close()
    return elapsed, cpu


def _confirm_each(
    connection: Any, options: PublisherOptions, queue: str, body: bytes, count: int
) -> tuple[float, float]:
    channel = connection.channel()
    channel.confirm_delivery()  # basic_publish now waits for each message's confirm
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        channel.basic_publish("", queue, body, _PERSISTENT)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    channel.close()
    return elapsed, cpu


def _streaming(
    connection: Any, options: PublisherOptions, queue: str, body: bytes, count: int
) -> tuple[float, float]:
    def publish_all(publisher: Publisher) -> list[Future[Confirmation]]:
        publish = publisher.publish
        return [publish("", queue, body) for _ in range(count)]

    return _confirmed_run(options, publish_all)


def _streaming_many(
    connection: Any, options: PublisherOptions, queue: str, body: bytes, count: int
) -> tuple[float, float]:
    def publish_all(publisher: Publisher) -> list[Future[Confirmation]]:
        futures: list[Future[Confirmation]] = []
        for start in range(0, count, 1000):
            futures += publisher.publish_many("", queue, [body] * min(1000, count - start))
        return futures

    return _confirmed_run(options, publish_all)


def _confirmed_run(
    options: PublisherOptions, publish_all: Callable[[Publisher], list[Future[Confirmation]]]
) -> tuple[float, float]:
    """Time ``publish_all`` and the flush after it on a new Publisher (not its connecting);
    raise unless every message was confirmed."""
    with Publisher(list(options.urls), **options.kwargs()) as publisher:
        started, cpu = time.perf_counter(), time.process_time()
        futures = publish_all(publisher)
        publisher.flush()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        raise ReliableAmqpError(f"{len(failed)} messages not confirmed, e.g. {failed[0]}")
    return elapsed, cpu


def _no_confirms(
    connection: Any, options: PublisherOptions, queue: str, body: bytes, count: int
) -> tuple[float, float]:
    channel = connection.channel()
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        channel.basic_publish("", queue, body, _PERSISTENT)
    # A synchronous method is answered after everything sent before it on this channel.
    channel.queue_declare(queue, passive=True)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    channel.close()
    return elapsed, cpu


#: mode -> runner: (seconds, client CPU seconds), both taken over the timed part only
RUNNERS: dict[str, Callable[[Any, PublisherOptions, str, bytes, int], tuple[float, float]]] = {
    "transactions": _transactions,
    "confirm-each": _confirm_each,
    "streaming": _streaming,
    "streaming-many": _streaming_many,
    "no-confirms": _no_confirms,
}
