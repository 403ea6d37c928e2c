"""``reliable-amqp inbox``: create an inbox's tables, look at it, prune it.

``init`` creates the tables (``--print-ddl`` prints them for a migration tool instead);
``status`` counts the claims kept, the oldest one's age and the attempts ledger's rows
(``--json``: one object with ``rows``, ``oldest_age_s``, ``attempts`` and
``pad_space_columns``); ``prune`` deletes claims older than the retention (``--older-than``,
default 7 days), one committed batch of at most ``--batch`` rows at a time.

Warnings go to stderr and leave the exit status alone: ``prune`` below 1 day (the floor,
``MIN_RETENTION``), which then prunes as asked; ``init`` and ``status`` on a MariaDB/MySQL
table whose keys ignore trailing spaces (made before they became varbinary), with the ALTER
that migrates it.
"""

from __future__ import annotations

import argparse
import json
import sys

from reliable_amqp.cli._outbox import _safe_db
from reliable_amqp.cli._parse import EXIT_CONNECTION, EXIT_OK

# Nothing of reliable_amqp.inbox is imported until an inbox action runs (building the parser
# imports none of it); hence the defaults written out here (a test checks them).
DEFAULT_TABLE = "amqp_inbox"
DEFAULT_RETENTION_DAYS = 7.0
MIN_RETENTION_DAYS = 1.0


def add_inbox_arguments(parser: argparse.ArgumentParser) -> None:
    """The sub-commands of ``reliable-amqp inbox``."""
    sub = parser.add_subparsers(dest="inbox_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--db",
            required=True,
            metavar="DSN",
            help="the database: postgresql://user@host:port/dbname, "
            "mysql://user:password@host:port/dbname or sqlite:///path/to/file.db",
        )
        p.add_argument("--table", default=DEFAULT_TABLE, help=f"(default {DEFAULT_TABLE})")
        p.add_argument("-v", "--verbose", action="count", default=0, help="show the library's log")

    init = sub.add_parser("init", help="create the inbox tables if missing")
    common(init)
    init.add_argument(
        "--print-ddl",
        action="store_true",
        help="print the statements for a migration tool instead of running them",
    )
    stat = sub.add_parser("status", help="claims kept, the oldest one's age, the ledger's size")
    common(stat)
    stat.add_argument("--json", action="store_true", help="print one JSON object")
    prune = sub.add_parser(
        "prune",
        help="delete claims older than the retention, in committed batches",
        description="Deletes claims (and attempts-ledger rows) older than --older-than days, at\n"
        "most --batch rows a statement, each batch committed before the next: writers wait\n"
        "for one short batch at most. Keep the retention longer than a message can spend\n"
        "being republished (spool, outbox, retries): a duplicate arriving after its claim was\n"
        f"pruned is handled again. Below {MIN_RETENTION_DAYS:g} day (the floor) it warns, then\n"
        "prunes as asked. See docs/inbox.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(prune)
    prune.add_argument(
        "--older-than",
        type=float,
        default=DEFAULT_RETENTION_DAYS,
        metavar="DAYS",
        help=f"retention in days (default {DEFAULT_RETENTION_DAYS:g})",
    )
    prune.add_argument("--scope", help="only this scope's rows (default: every scope)")
    prune.add_argument("--batch", type=int, default=1000, help="rows a statement (1000)")
    prune.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run_inbox(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp inbox ACTION``; a database that cannot be reached exits 3."""
    from reliable_amqp.inbox._schema import InboxTables
    from reliable_amqp.outbox._stores import database_errors

    InboxTables.named(args.table)  # a bad name is a usage error before any connection
    try:
        return _run(args)
    except database_errors() as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        print(
            f"reliable-amqp inbox {args.inbox_command}: the database {_safe_db(args.db)} "
            f"cannot be reached: {detail}",
            file=sys.stderr,
        )
        return EXIT_CONNECTION


def _warn(args: argparse.Namespace, message: str) -> None:
    print(f"reliable-amqp inbox {args.inbox_command}: warning: {message}", file=sys.stderr)


def _warn_padded(args: argparse.Namespace, columns: tuple[str, ...]) -> None:
    if columns:
        from reliable_amqp.inbox._schema import InboxTables, pad_space_message

        _warn(args, pad_space_message(InboxTables.named(args.table), columns))


def _run(args: argparse.Namespace) -> int:
    from reliable_amqp.inbox import Inbox, install, prune, status

    if args.inbox_command == "init":
        if args.print_ddl:
            scheme = args.db.split("://", 1)[0]
            dialect = {"sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}.get(
                scheme, "postgresql"
            )
            print(Inbox("-", args.table).ddl(dialect), end="")
            return EXIT_OK
        padded = install(args.db, args.table)
        print(f"inbox {args.table} ready in {_safe_db(args.db)}")
        _warn_padded(args, padded)
        return EXIT_OK
    if args.inbox_command == "status":
        found = status(args.db, args.table)
        _warn_padded(args, found.pad_space_columns)
        if args.json:
            print(json.dumps(found.as_dict()))
            return EXIT_OK
        age = "-" if found.oldest_age_s is None else f"{found.oldest_age_s:,.1f} s"
        print(f"inbox {args.table} in {_safe_db(args.db)}")
        print(f"  rows         {found.rows:>12,}")
        print(f"  oldest age   {age:>12}")
        print(f"  attempts     {found.attempts:>12,}")
        return EXIT_OK
    if args.older_than < 0 or args.batch < 1:
        from reliable_amqp._core.errors import ConfigurationError

        raise ConfigurationError("--older-than must be >= 0 days and --batch >= 1")
    if args.older_than < MIN_RETENTION_DAYS:
        _warn(
            args,
            f"--older-than {args.older_than:g} days is below the floor of "
            f"{MIN_RETENTION_DAYS:g} day: claims of messages that can still come again (a "
            "consumer's retries, a redelivery, a publisher's or the outbox relay's republish "
            "after an outage) are pruned, and such a duplicate is handled a second time. "
            "See docs/inbox.md, Retention and pruning",
        )
    deleted = prune(
        args.db, args.table, args.older_than * 86400.0, scope=args.scope, batch=args.batch
    )
    if args.json:
        print(json.dumps({"pruned": deleted}))
    else:
        print(f"inbox {args.table}: {deleted:,} rows pruned")
    return EXIT_OK


#: ``reliable-amqp inbox``, for build_parser(more=...): (name, help, description, arguments)
INBOX_COMMANDS = (
    (
        "inbox",
        "the inbox: init, status, prune",
        "Claims of handled messages (reliable_amqp.inbox), kept in your database to drop\n"
        "duplicates. See docs/inbox.md.",
        add_inbox_arguments,
    ),
)
