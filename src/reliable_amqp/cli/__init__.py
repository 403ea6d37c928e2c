"""The ``reliable-amqp`` command line: ``publish`` messages with confirms, ``bench`` a broker,
look into a ``spool``, relay an ``outbox``, ``consume`` a queue into a file, see and requeue
``dead-letters``, run a handler as a consuming service (``worker``).

Run ``reliable-amqp --help`` (or ``python -m reliable_amqp --help``). Exit codes: 0 every message
confirmed, 1 some not confirmed, 2 bad arguments or input (nothing published), 3 the broker could
not be reached or the connection was lost for good, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

from reliable_amqp._core.errors import ConfigurationError, SpoolError
from reliable_amqp.cli._bench import add_bench_arguments, run_bench
from reliable_amqp.cli._consume import CONSUME_COMMANDS, run_consume
from reliable_amqp.cli._dead_letters import DEAD_LETTERS_COMMANDS, run_dead_letters
from reliable_amqp.cli._inbox import INBOX_COMMANDS
from reliable_amqp.cli._outbox import add_outbox_arguments
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
    EXIT_INTERRUPTED,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    build_parser,
    printable,
)
from reliable_amqp.cli._publish import add_publish_arguments, run_publish
from reliable_amqp.cli._spool import add_spool_arguments, run_spool
from reliable_amqp.cli._worker import WORKER_COMMANDS, run_worker

__all__ = [
    "EXIT_CONNECTION",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_CONFIRMED",
    "EXIT_OK",
    "EXIT_USAGE",
    "main",
    "run",
]


def run() -> NoReturn:
    """The ``reliable-amqp`` program (its console script and ``python -m reliable_amqp``):
    :func:`main`, then exit with its code.

    Once :func:`main` has returned, the outcome is decided and said: a Ctrl-C that arrives while
    the process exits (a second press a moment after the first, say) changes neither the exit
    code nor the output, where Python's default handler would print a ``KeyboardInterrupt``
    traceback from the interpreter's shutdown and die of SIGINT. A second such press ends the
    process at once (streams flushed), with the same code, in case the shutdown hangs.
    """
    code: int | None = None
    while True:  # (a press between main() and the handler below: main's outcome stands)
        try:
            if code is None:
                code = main()
            signal.signal(signal.SIGINT, _LatePresses(code))
            break
        except KeyboardInterrupt:
            if code is None:  # main() itself did not catch it: interrupted while starting
                code = EXIT_INTERRUPTED
    sys.exit(code)


class _LatePresses:
    """SIGINT once the program's outcome is decided: the first press is ignored; the second
    flushes the standard streams and exits with the decided code at once."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.presses = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses > 1:
            for stream in (sys.stdout, sys.stderr):
                # closed or broken: nothing more to say there
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os._exit(self.code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    try:
        parser = build_parser(
            add_publish_arguments,
            add_bench_arguments,
            add_spool_arguments,
            add_outbox_arguments,
            more=(*CONSUME_COMMANDS, *DEAD_LETTERS_COMMANDS, *INBOX_COMMANDS, *WORKER_COMMANDS),
        )
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # while starting: nothing was done yet
        print("\nreliable-amqp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.command != "worker":  # a service's log: the worker configures its own
        _configure_logging(args.verbose)
    try:
        if args.command == "publish":
            return run_publish(args)
        if args.command == "spool":
            return run_spool(args)
        if args.command == "consume":
            return run_consume(args)
        if args.command == "dead-letters":
            return run_dead_letters(args)
        if args.command == "worker":
            return run_worker(args)
        if args.command == "outbox":
            from reliable_amqp.cli._outbox import run_outbox

            return run_outbox(args)
        if args.command == "inbox":
            from reliable_amqp.cli._inbox import run_inbox

            return run_inbox(args)
        return run_bench(args)
    except (UsageError, ConfigurationError, SpoolError) as exc:
        # one line, no traceback; a ConfigurationError never holds a password
        message = printable(exc).replace("\n", " ")
        print(f"reliable-amqp {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nreliable-amqp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _configure_logging(verbose: int) -> None:
    """Library warnings (reconnects, channel closes) with ``-v``, debug with ``-vv``.

    Without ``-v`` the library stays silent: the command reports every failure itself, once.
    """
    logger = logging.getLogger("reliable_amqp")
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if verbose == 1 else logging.DEBUG)
    else:
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
