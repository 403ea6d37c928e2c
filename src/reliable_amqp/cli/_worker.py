"""``reliable-amqp worker MODULE:HANDLER --queue Q``: a handler run as a consuming service.

The command imports ``MODULE`` and checks that ``HANDLER``'s kind matches ``--async`` before
anything is consumed (``_handler.py``), configures logging (INFO to stderr, with the process id) and
runs :class:`~reliable_amqp.Consumer` or :class:`~reliable_amqp.AsyncConsumer` until SIGTERM or
Ctrl-C, which the consumers turn into a graceful stop.

``--health-port`` serves the consumer's ``health()`` over HTTP (``_supervisor.HealthServer``);
``--processes N`` runs N consumers in child processes under a supervisor that restarts one that
dies (``_supervisor.Supervisor``). A child is this same command, started with the hidden
``--child INDEX:FD`` flag: it reads its options from :data:`ARGS_ENV` and writes its health to
the pipe ``FD`` once a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from reliable_amqp._consume import AsyncConsumer, Consumer
from reliable_amqp._consume._options import (
    DEFAULT_HANDLER_TIMEOUT,
    DEFAULT_PREFETCH,
    DEFAULT_REDELIVERY,
)
from reliable_amqp._core.errors import (
    AccessRefused,
    ConfigurationError,
    NotFound,
    ReliableAmqpError,
    ResourceLocked,
)
from reliable_amqp._core.options import PublisherOptions
from reliable_amqp.cli._consume import MAX_PREFETCH
from reliable_amqp.cli._handler import check_kind, load_handler
from reliable_amqp.cli._inbox import DEFAULT_TABLE as INBOX_TABLE
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_connection_arguments,
    check_options,
    count,
    count_at_least_one,
    printable,
    seconds,
)
from reliable_amqp.cli._supervisor import ARGS_ENV, HealthServer, Supervisor

log = logging.getLogger("reliable_amqp.worker")

#: every line: when, how bad, which process (several run side by side with --processes)
LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(message)s"
#: a child's options, as the JSON of the parent's parsed arguments
#: seconds between two health reports of a child to its parent
REPORT_INTERVAL = 1.0

AnyConsumer = Consumer | AsyncConsumer


def _timeout(text: str) -> float | None:
    if text.strip().lower() in ("none", "off"):
        return None
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0 or none, got {text!r}")
    return value


def _port(text: str) -> int:
    value = count(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return value


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``reliable-amqp worker``."""
    parser.add_argument(
        "target",
        metavar="MODULE:HANDLER",
        help="the handler: a function (or any callable) HANDLER in MODULE, imported with the "
        "current directory on the path, e.g. myapp.orders:handle",
    )
    parser.add_argument("--queue", required=True, metavar="QUEUE", help="the queue to consume")
    parser.add_argument(
        "--async",
        dest="is_async",
        action="store_true",
        help="HANDLER is a coroutine function (async def), run by AsyncConsumer",
    )
    parser.add_argument(
        "--concurrency",
        type=count_at_least_one,
        default=1,
        metavar="N",
        help="handlers running at once in each process (default 1; above 1 needs --async)",
    )
    parser.add_argument(
        "--prefetch",
        type=count_at_least_one,
        default=DEFAULT_PREFETCH,
        metavar="N",
        help=f"unacknowledged messages per process, at most (default {DEFAULT_PREFETCH})",
    )
    parser.add_argument(
        "--processes",
        type=count_at_least_one,
        metavar="N",
        help="run N consumer processes and restart one that dies (default: consume in this "
        "process)",
    )
    health = parser.add_argument_group("health")
    health.add_argument(
        "--health-port",
        type=_port,
        metavar="PORT",
        help="serve GET /healthz and /readyz on PORT: 200 and the health as JSON when "
        "consuming, 503 when not (0: any free port, logged)",
    )
    health.add_argument(
        "--health-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address to serve health on (default 127.0.0.1; 0.0.0.0 in a container)",
    )
    consumer = parser.add_argument_group("consumer options")
    consumer.add_argument(
        "--declare",
        action="store_true",
        help="declare the queue (durable) before consuming, and again after each reconnect",
    )
    consumer.add_argument(
        "--key",
        metavar="KEY",
        help="keep per-key order: routing_key, or header:NAME (docs/consumer.md, Order)",
    )
    consumer.add_argument(
        "--partitions",
        type=count_at_least_one,
        metavar="N",
        help="QUEUE names a group of N partitions (QUEUE.0..QUEUE.<N-1>, consistent-hash "
        "exchange QUEUE): this worker's processes join it and share them; every member of "
        "the group must give the same N (docs/consumer.md, Partitions)",
    )
    consumer.add_argument(
        "--max-attempts",
        type=count_at_least_one,
        default=DEFAULT_REDELIVERY.max_attempts,
        metavar="N",
        help="tries of a failing message before it is dead-lettered "
        f"(default {DEFAULT_REDELIVERY.max_attempts})",
    )
    consumer.add_argument(
        "--redelivery-delay",
        type=seconds,
        default=DEFAULT_REDELIVERY.initial_delay,
        metavar="SECONDS",
        help="wait before the first retry of a failed message "
        f"(default {DEFAULT_REDELIVERY.initial_delay:g}); it doubles each time",
    )
    consumer.add_argument(
        "--redelivery-max-delay",
        type=seconds,
        default=DEFAULT_REDELIVERY.max_delay,
        metavar="SECONDS",
        help=f"longest wait between retries (default {DEFAULT_REDELIVERY.max_delay:g})",
    )
    consumer.add_argument(
        "--dead-letter-queue", metavar="NAME", help="where dead letters go (default QUEUE.dead)"
    )
    consumer.add_argument(
        "--handler-timeout",
        type=_timeout,
        default=DEFAULT_HANDLER_TIMEOUT,
        metavar="SECONDS",
        help="a handler running longer is reported (sync) or cancelled and retried (async), and "
        f"the health turns bad (default {DEFAULT_HANDLER_TIMEOUT:g}; none: no limit)",
    )
    consumer.add_argument(
        "--stop-timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running handlers may take to finish (default 30)",
    )
    consumer.add_argument(
        "--heartbeat",
        type=count,
        metavar="SECONDS",
        help="AMQP heartbeat (default 5; 0: none)",
    )
    ledger = parser.add_argument_group("attempts ledger (see docs/inbox.md)")
    ledger.add_argument(
        "--attempts-db",
        metavar="DSN",
        help="count redeliveries in the inbox's attempts ledger in this database "
        "(postgresql://..., mysql://..., sqlite:///...): a message that kills the process "
        "every time is dead-lettered after --max-attempts, on classic queues too",
    )
    ledger.add_argument(
        "--attempts-scope",
        metavar="SCOPE",
        help="the ledger's scope: your Inbox's scope (default: QUEUE)",
    )
    ledger.add_argument(
        "--attempts-table",
        default=INBOX_TABLE,
        metavar="TABLE",
        help=f"the inbox's table (default {INBOX_TABLE}; the ledger is TABLE_attempts)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_connection_arguments(parser)


# --- the consumer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process runs: the handler and the consumer's keyword options."""

    target: str
    queue: str
    handler: Callable[..., Any]
    is_async: bool
    urls: list[str]
    options: dict[str, Any]

    def consumer(self) -> AnyConsumer:
        """A new (not yet running) consumer."""
        kind = AsyncConsumer if self.is_async else Consumer
        return kind(self.urls, self.queue, **self.options)


def prepare(args: argparse.Namespace) -> WorkerSpec:
    """The handler imported and checked, the options validated (a consumer is built and left
    unused: its constructor opens nothing); raises UsageError or ConfigurationError."""
    if args.concurrency > 1 and not args.is_async:
        raise UsageError(
            "--concurrency above 1 needs --async: a sync handler runs one delivery at a time "
            "in a process (use --processes N for more)"
        )
    if args.prefetch > MAX_PREFETCH:
        raise UsageError(f"--prefetch is at most {MAX_PREFETCH:,} (AMQP's prefetch count)")
    handler = load_handler(args.target)
    check_kind(args.target, handler, args.is_async)
    connection = check_options(args)
    # the publisher options given (flags, -o, TLS, credentials), and only those: the consumer
    # has defaults of its own (it keeps reconnecting for 10 minutes, a publisher for 60 s)
    defaults = PublisherOptions.create(list(connection.urls)).kwargs()
    options = {k: v for k, v in connection.kwargs().items() if v != defaults[k]}
    if args.connect_retries is not None or any(k.startswith("connect_") for k, _ in args.options):
        options["connect_policy"] = connection.connect_policy  # even the publisher's default
    options.update(
        prefetch=args.prefetch,
        redelivery=replace(
            DEFAULT_REDELIVERY,
            max_attempts=args.max_attempts,
            initial_delay=args.redelivery_delay,
            max_delay=max(args.redelivery_max_delay, args.redelivery_delay),
        ),
        dead_letter_queue=args.dead_letter_queue,
        stop_timeout=args.stop_timeout,
        handler_timeout=args.handler_timeout,
        declare=args.declare,
    )
    if args.key is not None:
        options["key"] = args.key
    if args.partitions is not None:
        options["partitions"] = args.partitions
    if args.heartbeat is not None:
        options["heartbeat"] = args.heartbeat
    if args.is_async:
        options["concurrency"] = args.concurrency
    if args.attempts_db:
        options["attempts"] = attempts_counter(args)
    spec = WorkerSpec(
        args.target, args.queue, handler, args.is_async, list(connection.urls), options
    )
    spec.consumer()  # the options are checked here, before any process starts
    return spec


def attempts_counter(args: argparse.Namespace) -> Callable[[Any], Any]:
    """``attempts=`` for the consumer: the inbox's ``record_attempt`` on a connection opened for
    each redelivered message (a first delivery costs nothing); checked against the database
    now (a missing ledger is a usage error, an unreachable database exit 3)."""
    from reliable_amqp.inbox import Inbox, status
    from reliable_amqp.outbox._stores import database_errors

    inbox = Inbox(args.attempts_scope or args.queue, args.attempts_table)
    opener = _opener(args.attempts_db)
    try:
        status(args.attempts_db, args.attempts_table)  # the tables exist: else `inbox init`
    except database_errors() as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise _DatabaseUnreachable(f"--attempts-db cannot be reached: {detail}") from None

    def count_attempt(delivery: Any) -> int:
        return inbox.record_attempt(opener, delivery)

    if not args.is_async:
        return count_attempt

    async def count_attempt_async(delivery: Any) -> int:
        # a database round trip: off the event loop, where the other handlers run
        return await asyncio.to_thread(count_attempt, delivery)

    return count_attempt_async


class _DatabaseUnreachable(Exception):
    """The ``--attempts-db`` database did not answer (exit 3)."""


def _opener(db: str) -> Callable[[], Any]:
    """A callable that opens a connection to ``db`` (no transaction open)."""
    if db.startswith(("postgresql://", "postgres://")):
        from reliable_amqp.outbox import _pg

        psycopg = _pg.require_psycopg()
        return lambda: psycopg.connect(db)
    if db.startswith("sqlite:///"):
        import sqlite3

        from reliable_amqp.outbox import _sqlite

        path = _sqlite.path_of(db)
        return lambda: sqlite3.connect(path, timeout=_sqlite.BUSY_TIMEOUT)
    if db.startswith(("mysql://", "mariadb://")):
        from reliable_amqp.outbox import _mysql

        connect_args = _mysql.connect_args(db)
        return lambda: _mysql.open_connection(connect_args, autocommit=False)
    raise UsageError(
        "--attempts-db: expected postgresql://user@host:port/dbname, "
        "mysql://user@host:port/dbname or sqlite:///path/to/file.db"
    )


def consume(spec: WorkerSpec, consumer: AnyConsumer) -> int:
    """Run ``consumer`` until it is stopped; the exit code."""
    what = "async" if spec.is_async else "sync"
    log.info("worker: consuming %r with %s (%s handler)", spec.queue, spec.target, what)
    try:
        if isinstance(consumer, AsyncConsumer):
            asyncio.run(consumer.run(spec.handler))
        else:
            consumer.run(spec.handler)
    except ConfigurationError:
        raise  # a usage error (exit 2), whenever the library finds it
    except (NotFound, AccessRefused, ResourceLocked) as exc:
        # retrying cannot help (a supervisor does not restart a child that exits 2)
        hint = "" if spec.options.get("declare") else " (the worker declares it with --declare)"
        hint = hint if isinstance(exc, NotFound) else ""
        log.error("worker: cannot consume %r: %s%s", spec.queue, printable(exc), hint)
        return EXIT_USAGE
    except ReliableAmqpError as exc:
        log.error("worker: consuming %r ended: %s: %s", spec.queue, type(exc).__name__, exc)
        return EXIT_CONNECTION
    return EXIT_OK


def configure_logging(verbose: int) -> None:
    """INFO and above to stderr, each line with its time, level and process id; the
    library's DEBUG too with ``-v``. The handler's own loggers are shown as well."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    if verbose:
        logging.getLogger("reliable_amqp").setLevel(logging.DEBUG)


# --- the command ---------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp worker``; returns the exit code."""
    if args.child is not None:
        return _run_child(args.child)
    configure_logging(args.verbose)
    try:
        spec = prepare(args)
    except _DatabaseUnreachable as exc:
        print(f"reliable-amqp worker: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    if args.processes is not None:
        return Supervisor(args, spec).run()
    consumer = spec.consumer()
    server = None
    if args.health_port is not None:
        server = HealthServer(args.health_host, args.health_port, lambda: _health(consumer))
        server.start()
    try:
        return consume(spec, consumer)
    finally:
        if server is not None:
            server.close()


def _health(consumer: AnyConsumer) -> tuple[bool, dict[str, object]]:
    health = consumer.health()
    return health.healthy, health.as_dict()


def _run_child(child: str) -> int:
    """A consumer process of a supervisor: its options from :data:`ARGS_ENV`, its health to the
    pipe named by ``--child INDEX:FD``."""
    index, _, fd_text = child.partition(":")
    given = json.loads(os.environ.pop(ARGS_ENV))
    args = argparse.Namespace(**given)
    configure_logging(args.verbose)
    try:
        spec = prepare(args)
    except _DatabaseUnreachable as exc:
        log.error("worker: %s", exc)
        return EXIT_CONNECTION
    consumer = spec.consumer()
    stop = threading.Event()
    reporter = threading.Thread(
        target=_report,
        args=(consumer, int(fd_text), stop),
        name=f"reliable-amqp-worker-report-{index}",
        daemon=True,
    )
    reporter.start()
    try:
        return consume(spec, consumer)
    finally:
        stop.set()


def _report(consumer: AnyConsumer, fd: int, stop: threading.Event) -> None:
    """Write the consumer's health to ``fd``, one JSON line a second (under PIPE_BUF: each
    write is whole); the parent gone, stop consuming (an orphan would go on alone)."""
    try:
        while True:
            line = json.dumps(consumer.health().as_dict()) + "\n"
            os.write(fd, line.encode())
            if stop.wait(REPORT_INTERVAL):
                return
    except OSError:  # EPIPE: the parent's end is closed
        if not stop.is_set():
            log.error("worker: the supervising process is gone; stopping")
            consumer.stop()
    finally:
        os.close(fd)


#: the sub-command of this module, for ``build_parser(more=...)``
WORKER_COMMANDS = (
    (
        "worker",
        "run a handler on a queue's messages as a service: processes, health, graceful stop",
        "Import HANDLER from MODULE and run it on every message of QUEUE with Consumer\n"
        "(AsyncConsumer with --async): ack after the work, retries, dead letters. Logs to\n"
        "stderr; SIGTERM or Ctrl-C stop gracefully. See docs/cli.md.",
        add_worker_arguments,
    ),
)
