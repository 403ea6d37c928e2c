"""``reliable-amqp publish``: publish a file of messages, each confirmed, and account for all.

Order of events: parse and validate the whole input (exit 2 on any bad line, nothing sent);
connect; declare the queue if asked; publish every message without waiting on each; wait for
every confirm; write the ones that were not confirmed to ``--failed``; print a summary per outcome.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO, Any

from reliable_amqp._core.errors import (
    AmqpConnectionError,
    BrokerError,
    ConfigurationError,
    DeliveryTimeout,
    MessageNacked,
    MessageRejected,
    MessageReturned,
    PublisherClosed,
    PublishError,
    PublishTimeout,
    ReliableAmqpError,
)
from reliable_amqp._core.message import Confirmation
from reliable_amqp._core.options import PublisherOptions, redact_url
from reliable_amqp._spool import inspect as inspect_spool
from reliable_amqp._sync.publisher import Publisher
from reliable_amqp.cli._interrupt import Interrupts
from reliable_amqp.cli._io import (
    Defaults,
    InputError,
    Item,
    Progress,
    RetryStatus,
    open_failed_file,
    read_messages,
)
from reliable_amqp.cli._io import write_failures as _write_failures
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
    EXIT_INTERRUPTED,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_connection_arguments,
    check_options,
    printable,
)
from reliable_amqp.cli._spool import SpoolRun

#: seconds an interrupted run waits for the confirms of what it sent before it closes
INTERRUPTED_CLOSE = 1.0

#: Summary lines, in order: label, the outcome it counts, and what to do about it.
OUTCOMES: tuple[tuple[str, type[BaseException] | None, str], ...] = (
    ("nacked", MessageNacked, "the broker refused them (a full queue?) and nack retries ran out"),
    ("returned", MessageReturned, "unroutable: no queue is bound for their routing key"),
    ("rejected", MessageRejected, "the broker closed the channel over them (missing exchange?)"),
    ("timed out", DeliveryTimeout, "no confirm within --delivery-timeout"),
    ("not confirmed", PublisherClosed, "the connection was lost for good, or interrupted"),
    ("not published", None, "never sent: the run stopped first"),
)


def add_publish_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``reliable-amqp publish``."""
    parser.add_argument(
        "input", nargs="?", default="-", metavar="FILE", help="messages to publish (default: stdin)"
    )
    parser.add_argument(
        "--format",
        choices=("lines", "jsonl"),
        default="lines",
        help="lines: each line is a message body; jsonl: each line is a JSON object with body, "
        "routing_key, exchange, headers, properties (default: lines)",
    )
    parser.add_argument("--exchange", default="", help="exchange (default: the default exchange)")
    parser.add_argument("--routing-key", help="routing key of every message without one of its own")
    parser.add_argument(
        "--declare-queue",
        metavar="NAME",
        help="declare this durable queue first; publishing to the default exchange, the routing "
        "key defaults to it",
    )
    parser.add_argument(
        "--mandatory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="unroutable messages fail as returned (the default); --no-mandatory lets the "
        "broker confirm and drop them",
    )
    parser.add_argument("--content-type", help="content type of every message without its own")
    parser.add_argument(
        "--header",
        dest="headers",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a header on every message (repeatable; a message's own headers win)",
    )
    parser.add_argument(
        "--failed",
        metavar="PATH",
        help="write every message that was not confirmed, with the reason, to PATH as JSON lines "
        "(replay with --format jsonl PATH); rewritten, possibly empty, by every run that "
        "publishes; created readable by you alone (0600); a symbolic link is refused",
    )
    parser.add_argument(
        "--spool",
        metavar="DIR",
        help="keep every message in a durable spool in DIR until the broker confirms it "
        "(docs/spool.md): a run that is stopped, crashes or loses the broker leaves the rest "
        "there, and the next run with --spool DIR sends it first (even with empty input)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar and no summary (errors only)"
    )
    add_connection_arguments(parser)


def _defaults(args: argparse.Namespace) -> Defaults:
    routing_key: str | None = args.routing_key
    if routing_key is None and args.exchange:
        routing_key = ""  # fanout and headers exchanges ignore it
    if routing_key is None and args.declare_queue:
        routing_key = args.declare_queue
    if routing_key is None and args.format == "lines":
        raise UsageError(
            "no routing key: pass --routing-key KEY (or --declare-queue NAME to publish to that "
            "queue, or --exchange NAME)"
        )
    properties: dict[str, Any] = {}
    if args.content_type:
        properties["content_type"] = args.content_type
    if args.headers:
        properties["headers"] = dict(h.partition("=")[::2] for h in args.headers)
        if any("=" not in h for h in args.headers):
            raise UsageError("--header expects KEY=VALUE")
    return Defaults(args.exchange, routing_key, args.mandatory, properties)


def _read(args: argparse.Namespace, defaults: Defaults) -> list[Item]:
    if args.input == "-":
        if sys.stdin.isatty():
            print(
                "reading messages from the terminal, one per line; end with Ctrl-D", file=sys.stderr
            )
        return read_messages(sys.stdin.buffer, "<stdin>", args.format, defaults)
    # a large input takes seconds to check: on a terminal, say so meanwhile
    show = sys.stderr.isatty() and not args.quiet
    if show:
        print(f"reliable-amqp: reading and checking {args.input} ...", end="", file=sys.stderr)
        sys.stderr.flush()
    try:
        with open(args.input, "rb") as stream:
            return read_messages(stream, args.input, args.format, defaults)
    except OSError as exc:
        raise UsageError(f"cannot read {args.input}: {exc.strerror or exc}") from None
    finally:
        if show:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


class _Tally:
    """Outcomes as futures resolve (future callbacks run on the publisher's I/O thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.confirmed = 0
        self.failures: list[tuple[Item, BaseException | str]] = []
        #: from the first publish until every outcome was in (for the rate in the summary)
        self.publishing = 0.0
        #: the connection problem the run printed (once), if it printed one
        self.said: str | None = None

    def watch(self, item: Item) -> Callable[[Future[Confirmation]], None]:
        def done(future: Future[Confirmation]) -> None:
            error = None if future.cancelled() else future.exception()
            with self._lock:
                if error is None:
                    self.confirmed += 1
                else:
                    self.failures.append((item, error))

        return done

    def add(self, items: list[Item], reason: str) -> None:
        with self._lock:
            self.failures.extend((item, reason) for item in items)

    @property
    def failed(self) -> int:
        return len(self.failures)


def run_publish(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp publish``; returns the exit code."""
    with Interrupts() as interrupts:
        return _run(args, interrupts)


def _run(args: argparse.Namespace, interrupts: Interrupts) -> int:
    options = check_options(args)
    try:
        items = _read(args, _defaults(args))  # Ctrl-C here: nothing was sent, exit 130
    except InputError as exc:
        print(f"reliable-amqp: bad input, nothing was published:\n{exc}", file=sys.stderr)
        return EXIT_USAGE
    # from here on, every message is accounted for in --failed, Ctrl-C or not (_interrupt)
    interrupts.deferring = True
    # opened before anything is sent: a --failed that cannot be written is a usage error
    failed_stream = open_failed_file(args.failed) if args.failed else None
    tally = _Tally()
    # what the spool holds before the run: recovered messages, counted in the summary
    spool_run = SpoolRun(options.spool) if options.spool is not None else None
    progress = Progress(
        len(items), sys.stderr, sys.stderr.isatty() and not (args.quiet or args.no_progress)
    )
    # on a terminal, retries show as they happen (with -v the library's log says it)
    status = RetryStatus(
        sys.stderr,
        progress,
        options.connect_policy.max_attempts,
        draw=sys.stderr.isatty() and not args.quiet and not args.verbose,
    )
    started = time.monotonic()
    try:
        code = _publish_all(
            args, options, items, tally, progress, interrupts=interrupts, status=status
        )
    except BaseException:
        if failed_stream is not None:
            failed_stream.close()
        raise
    interrupts.deferring = True  # the outcomes are written whole (a second Ctrl-C still stops)
    if progress.drawn or status.connected:  # not for a run that never got to publish
        progress.finish(tally.confirmed, tally.failed)
    if spool_run is not None:  # what the spool keeps is no failure (nor for --failed: twice)
        kept = [pair for pair in tally.failures if isinstance(pair[1], PublisherClosed)]
        tally.failures = [p for p in tally.failures if not isinstance(p[1], PublisherClosed)]
        spool_run.finish(len(kept))
        spool_run.report_failed(sys.stderr)
    failures = sorted(tally.failures, key=lambda pair: pair[0].line)
    if failed_stream is not None:
        try:
            with failed_stream:
                failed_stream.truncate(0)
                _write_failures(failed_stream, failures)
        except OSError as exc:
            print(
                f"reliable-amqp: cannot write {args.failed}: {exc.strerror or exc}",
                file=sys.stderr,
            )
            _list_failures(failures, sys.stderr, limit=None, said=tally.said)
            return max(code, EXIT_NOT_CONFIRMED)
    elif failures:
        _list_failures(failures, sys.stderr, limit=20, said=tally.said)
    if not args.quiet:
        _summary(
            args,
            options,
            total=len(items),
            confirmed=tally.confirmed,
            failures=failures,
            elapsed=time.monotonic() - started,
            publishing=tally.publishing,
        )
        if spool_run is not None:
            spool_run.summary(sys.stdout)
    if code == EXIT_OK and failures:
        code = EXIT_NOT_CONFIRMED
    if spool_run is not None:
        code = spool_run.exit_code(code)
    if interrupts.pending:  # Ctrl-C while the outcomes were written: they were, then stop
        code = EXIT_INTERRUPTED
    return code


def _publish_all(
    args: argparse.Namespace,
    options: PublisherOptions,
    items: list[Item],
    tally: _Tally,
    progress: Progress,
    *,
    interrupts: Interrupts,
    status: RetryStatus | None = None,
) -> int:
    """Publish every item, wait for every outcome; returns the exit code so far."""
    if not items and options.spool is None:
        interrupts.check()
        return EXIT_OK
    kwargs = options.kwargs()
    if status is not None:
        kwargs["on_event"] = status.on_event
    publisher = Publisher(list(options.urls), **kwargs)
    published = 0
    code = EXIT_OK
    close_timeout: float | None = None  # close_timeout: after the last flush, it has no wait
    try:
        # connecting and declaring wait in the publisher's waits, where Ctrl-C is safe
        interrupts.deferring = False
        interrupts.check()  # one that came while the run was set up
        publisher.connect()
        if args.declare_queue:
            publisher.declare_queue(args.declare_queue, durable=True)
        publish = publisher.publish_message
        started = time.monotonic()
        # a message handed over is counted, with its callback, before a Ctrl-C is obeyed
        interrupts.deferring = True
        for item in items:
            future = publish(item.message)
            future.add_done_callback(tally.watch(item))
            published += 1
            if interrupts.pending:
                interrupts.check()
            if not published & 255:
                progress.update(tally.confirmed, tally.failed)
        interrupts.deferring = False
        interrupts.check()
        while publisher.flush(0.1):
            progress.update(tally.confirmed, tally.failed)
        tally.publishing = time.monotonic() - started
    except KeyboardInterrupt:
        interrupts.deferring = True  # what follows runs whole (a second Ctrl-C still stops)
        print("\nreliable-amqp: interrupted; settling what was sent", file=sys.stderr)
        code = EXIT_INTERRUPTED
        tally.add(items[published:], "not sent: interrupted")
        published = len(items)
        close_timeout = INTERRUPTED_CLOSE
    except BrokerError as exc:  # the declaration was refused
        print(
            f"reliable-amqp: cannot declare queue {args.declare_queue!r}: {printable(exc)}",
            file=sys.stderr,
        )
        code = EXIT_USAGE
    except ConfigurationError:
        raise  # exit 2 (main), nothing was published
    except (PublishError, ReliableAmqpError) as exc:
        # Connecting failed, or the connection was given up (publish() raises PublisherClosed),
        # or the window stayed full for publish_timeout: what was sent settles; the rest stays.
        problem = printable(_connection_problem(options, exc))
        if status is not None:
            status.clear()
        print(f"reliable-amqp: {problem}", file=sys.stderr)  # the one place it is said
        tally.said = problem
        code = EXIT_CONNECTION
        tally.add(items[published:], f"not sent: {_unsent(exc)}")
        published = len(items)
    finally:
        interrupts.deferring = True
        if published < len(items):
            tally.add(items[published:], "not sent: the run stopped first")
        try:
            publisher.close(timeout=close_timeout)
        except KeyboardInterrupt:  # Ctrl-C (again) while closing: stop waiting for confirms
            code = EXIT_INTERRUPTED
            publisher.close(timeout=0)
    if status is not None and status.gave_up is not None and tally.said is None:
        # the publisher gave up while nothing raised (the messages in flight failed, or wait in
        # the spool): the reason is said here, once
        status.clear()
        if status.connected:
            urls = ", ".join(redact_url(u) for u in options.urls)
            tally.said = printable(f"the connection to {urls} was given up: {status.gave_up}")
        else:
            tally.said = printable(_connection_problem(options, status.gave_up))
        print(f"reliable-amqp: {tally.said}", file=sys.stderr)
    if options.spool is not None:
        left = inspect_spool(options.spool).pending
        if left:
            print(
                f"reliable-amqp: {left:,} messages stay in the spool {options.spool}; the next "
                f"run with --spool {options.spool} sends them first",
                file=sys.stderr,
            )
            code = max(code, EXIT_CONNECTION)
    if code == EXIT_OK and any(isinstance(e, PublisherClosed) for _, e in tally.failures):
        code = EXIT_CONNECTION
    return code


def _unsent(exc: BaseException) -> str:
    """Why messages were not sent, short: the error itself was printed once already."""
    if isinstance(exc, PublishTimeout):
        return "the broker stopped confirming"
    if isinstance(exc, (AmqpConnectionError, PublisherClosed)):
        return "no connection to the broker"
    return "publishing failed"


def _connection_problem(options: PublisherOptions, exc: BaseException) -> str:
    urls = ", ".join(redact_url(u) for u in options.urls)
    if isinstance(exc, PublisherClosed):
        return f"the connection to {urls} was given up: {exc.reason or exc}"
    if isinstance(exc, AmqpConnectionError):
        return f"cannot connect to {urls}: {exc}"
    if isinstance(exc, PublishTimeout):
        return f"the broker at {urls} stopped confirming: {exc}"
    return f"publishing to {urls} failed: {exc}"


def _label(error: BaseException | str) -> str:
    for label, cls, _ in OUTCOMES:
        if cls is not None and isinstance(error, cls):
            return label
    return "not published" if isinstance(error, str) else "failed"


def _list_failures(
    failures: list[tuple[Item, BaseException | str]],
    stream: IO[str],
    limit: int | None,
    *,
    said: str | None = None,
) -> None:
    """Print failures, one line each; messages never sent, and those the closed publisher
    failed (all for one reason), are grouped by reason: the reason is said once, and not again
    when it is the connection problem the run printed already (``said``)."""
    unsent: dict[str, list[int]] = {}
    shown = 0
    for item, error in failures:
        group = error if isinstance(error, str) else None
        if isinstance(error, PublisherClosed):
            reason = printable(error.reason or "the publisher closed")
            if said is not None and reason in said:
                reason = "no connection to the broker"
            group = f"not confirmed: {reason}"
        if group is not None:
            unsent.setdefault(group, []).append(item.line)
        elif limit is None or shown < limit:
            print(f"line {item.line}: {_label(error)}: {printable(error)}", file=stream)
            shown += 1
    hidden = len(failures) - shown - sum(len(lines) for lines in unsent.values())
    if hidden:
        print(f"... and {hidden:,} more; use --failed PATH to keep every one", file=stream)
    for reason, lines in unsent.items():
        where = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]} to {lines[-1]}"
        print(f"{_messages(len(lines))} ({where}) {printable(reason)}", file=stream)


def _summary(
    args: argparse.Namespace,
    options: PublisherOptions,
    *,
    total: int,
    confirmed: int,
    failures: list[tuple[Item, BaseException | str]],
    elapsed: float,
    publishing: float,
) -> None:
    urls = ", ".join(redact_url(u) for u in options.urls)
    source = "stdin" if args.input == "-" else args.input
    rate = (
        f" ({confirmed / publishing:,.0f} confirmed/s)"
        if confirmed >= 100 and publishing > 0
        else ""
    )
    print(f"{_messages(total)} from {source} to {urls} in {elapsed:.2f} s{rate}")
    counts: dict[str, int] = {}
    for _, error in failures:
        label = _label(error)
        counts[label] = counts.get(label, 0) + 1
    print(f"  {'confirmed':<14}{confirmed:>10,}")
    for label, _, meaning in (*OUTCOMES, ("failed", None, "")):
        if counts.get(label):
            print(f"  {label:<14}{counts[label]:>10,}   {meaning}".rstrip())
    if failures and args.failed:
        print(
            f"{_messages(len(failures))} not confirmed written to {args.failed}; "
            f"publish them again with: reliable-amqp publish --format jsonl {args.failed}"
        )


def _messages(count: int) -> str:
    return f"{count:,} message" if count == 1 else f"{count:,} messages"
