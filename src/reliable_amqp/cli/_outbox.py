"""``reliable-amqp outbox``: create an outbox, relay it, look at it, deal with its failed rows.

``init`` creates the tables (``--print-ddl`` prints them for a migration tool instead);
``relay`` publishes committed rows through the confirming publisher until SIGTERM or SIGINT
(which stop reading, wait for the confirms in flight, bounded by ``--stop-timeout``, and exit 0;
a second Ctrl-C exits 130 at once); ``status`` counts pending and failed rows, the oldest age
and the relays at work; ``failed`` lists, exports, retries or drops the failed rows.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from reliable_amqp.cli._io import ERROR_FIELD, _json_default, open_failed_file, set_properties
from reliable_amqp.cli._parse import (
    EXIT_CONNECTION,
    EXIT_INTERRUPTED,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    UsageError,
)

if TYPE_CHECKING:
    from reliable_amqp.outbox._tools import FailedRow

# Nothing of reliable_amqp.outbox (its relay, its tools, the database drivers) is imported until
# an outbox action runs: building the parser, which every command does (`publish` included),
# imports none of it. Hence the default table's name written out here (a test checks it).
DEFAULT_TABLE = "amqp_outbox"

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def add_outbox_arguments(parser: argparse.ArgumentParser) -> None:
    """The sub-commands of ``reliable-amqp outbox``."""
    sub = parser.add_subparsers(dest="outbox_command", metavar="ACTION", required=True)

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

    init = sub.add_parser("init", help="create the outbox tables if missing")
    common(init)
    init.add_argument(
        "--print-ddl",
        action="store_true",
        help="print the statements for a migration tool instead of running them",
    )
    relay = sub.add_parser(
        "relay",
        help="publish committed rows, each deleted once the broker confirmed it",
        description="Publishes the outbox's committed rows with publisher confirms (mandatory),\n"
        "deleting each row only after its confirm. SIGTERM or Ctrl-C stops reading, waits for\n"
        "the confirms in flight (--stop-timeout) and exits 0; a second Ctrl-C exits 130.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(relay)
    relay.add_argument(
        "--url",
        default=os.environ.get("AMQP_URL", DEFAULT_URL),
        help="the broker (default $AMQP_URL or amqp://guest:***@127.0.0.1:5672/%%2F)",
    )
    relay.add_argument(
        "--until-empty",
        action="store_true",
        help="exit 0 once no committed row is pending and nothing is in flight",
    )
    relay.add_argument("--name", help="this relay's name in `outbox status` (default host:pid)")
    relay.add_argument("--batch", type=int, default=1000, help="rows read at once (1000)")
    relay.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the confirms in flight when stopping (30)",
    )
    stat = sub.add_parser("status", help="pending and failed rows, oldest age, relays at work")
    common(stat)
    stat.add_argument("--json", action="store_true", help="print one JSON object")
    failed = sub.add_parser(
        "failed",
        help="list failed rows; export, retry or drop them",
        description="Rows the broker refused for good (nacked, returned, rejected). --export\n"
        "writes them as JSON lines that `reliable-amqp publish --format jsonl FILE` publishes\n"
        "again; --retry moves them back to the outbox (after the rows pending now); --drop\n"
        "deletes them (with --export: exactly what was exported).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(failed)
    action = failed.add_mutually_exclusive_group()
    action.add_argument("--retry", action="store_true", help="move them back to the outbox")
    action.add_argument("--drop", action="store_true", help="delete them")
    failed.add_argument("--export", metavar="FILE", help="write them to FILE as JSON lines")
    failed.add_argument(
        "--id",
        dest="ids",
        action="append",
        metavar="MESSAGE_ID",
        help="only this message id (repeatable)",
    )
    failed.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run_outbox(args: argparse.Namespace) -> int:
    """Run ``reliable-amqp outbox ACTION``; a database that cannot be reached exits 3."""
    from reliable_amqp.outbox._schema import Tables
    from reliable_amqp.outbox._stores import database_errors

    Tables.named(args.table)  # a bad name is a usage error before any connection
    try:
        return _run(args)
    except database_errors() as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        print(
            f"reliable-amqp outbox {args.outbox_command}: the database {_safe_db(args.db)} "
            f"cannot be reached: {detail}",
            file=sys.stderr,
        )
        return EXIT_CONNECTION


def _run(args: argparse.Namespace) -> int:
    action = args.outbox_command
    if action == "init":
        return _init(args)
    if action == "relay":
        return _relay(args)
    if action == "status":
        return _status(args)
    return _failed(args)


def _init(args: argparse.Namespace) -> int:
    from reliable_amqp.outbox import Outbox
    from reliable_amqp.outbox._schema import Tables
    from reliable_amqp.outbox._tools import install

    tables = Tables.named(args.table)
    if args.print_ddl:
        scheme = args.db.split("://", 1)[0]
        dialect = {"sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}.get(
            scheme, "postgresql"
        )
        print(Outbox(tables.name).ddl(dialect), end="")
        return EXIT_OK
    install(args.db, args.table)
    print(f"outbox {args.table} ready in {_safe_db(args.db)}")
    return EXIT_OK


def _relay(args: argparse.Namespace) -> int:
    from reliable_amqp._core.errors import AmqpConnectionError
    from reliable_amqp.outbox import OutboxRelay

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    outbox_log = logging.getLogger("reliable_amqp.outbox")
    outbox_log.addHandler(handler)
    outbox_log.setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
    outbox_log.propagate = False  # its own report: not twice with -v
    if args.batch <= 0:
        raise UsageError(f"--batch: expected a positive number, got {args.batch}")
    relay = OutboxRelay(
        args.db, args.url, table=args.table, batch=args.batch, name=args.name,
        stop_timeout=args.stop_timeout,
    )  # fmt: skip
    interrupts = 0

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                raise KeyboardInterrupt
        relay.stop()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    outbox_log.info(
        "outbox %s: relay %s publishing from %s", args.table, relay.name, _safe_db(args.db)
    )
    try:
        relay.run(until_empty=args.until_empty)
    except AmqpConnectionError as exc:
        print(f"reliable-amqp outbox relay: {exc}", file=sys.stderr)
        return EXIT_CONNECTION
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    stats = relay.stats()
    outbox_log.info(
        "outbox %s: relay %s stopped: %d published, %d confirmed, %d failed",
        args.table, relay.name, stats.published, stats.confirmed, stats.failed,
    )  # fmt: skip
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from reliable_amqp.outbox._tools import status

    found = status(args.db, args.table)
    if args.json:
        print(json.dumps(found.as_dict()))
        return EXIT_OK
    age = "-" if found.oldest_age_s is None else f"{found.oldest_age_s:,.1f} s"
    print(f"outbox {args.table} in {_safe_db(args.db)}")
    print(f"  pending      {found.pending:>12,}")
    print(f"  failed       {found.failed:>12,}")
    print(f"  oldest age   {age:>12}")
    print(f"  relays       {len(found.relays):>12}")
    for relay in found.relays:
        print(
            f"    {relay.name} (session {relay.session}, {relay.host}): "
            f"{relay.partitions} partitions, up {relay.up_s:,.0f} s"
        )
    for writer in found.open_writers:
        print(
            f"  open transaction with outbox rows: session {writer.session}, "
            f"{writer.age_s:,.1f} s{', ' + writer.application if writer.application else ''}"
        )
    return EXIT_OK


def _failed(args: argparse.Namespace) -> int:
    from reliable_amqp.outbox._tools import drop_failed, failed_rows, retry_failed

    rows = failed_rows(args.db, args.table)
    if args.ids:
        wanted = set(args.ids)
        rows = [r for r in rows if r.message_id in wanted]
    exported = None
    if args.export:
        with open_failed_file(args.export, flag="--export") as stream:
            stream.truncate(0)
            for row in rows:
                stream.write(json.dumps(failed_record(row), default=_json_default))
                stream.write("\n")
        exported = len(rows)
    ids = [r.message_id for r in rows] if (args.ids or args.export) else None
    retried = retry_failed(args.db, args.table, ids) if args.retry else None
    dropped = drop_failed(args.db, args.table, ids) if args.drop else None
    if args.json:
        out: dict[str, Any] = {"failed": len(rows)}
        for name, value in (("exported", exported), ("retried", retried), ("dropped", dropped)):
            if value is not None:
                out[name] = value
        print(json.dumps(out))
        return EXIT_OK
    if exported is not None:
        print(f"{exported:,} failed rows written to {args.export}")
    if retried is not None:
        print(f"{retried:,} failed rows moved back to the outbox")
    elif dropped is not None:
        print(f"{dropped:,} failed rows dropped")
    else:
        for row in rows:
            when = dt.datetime.fromtimestamp(row.failed_at, dt.timezone.utc).isoformat()
            print(
                f"{row.message_id}  {row.exchange or '(default)'} {row.routing_key}  "
                f"key={row.key}  attempts={row.attempts}  {when}  {row.reason}"
            )
        print(f"{len(rows):,} failed rows")
    return EXIT_NOT_CONFIRMED if rows and not (retried or dropped) else EXIT_OK


def failed_record(row: FailedRow) -> dict[str, Any]:
    """The JSON line of a failed row (``publish --format jsonl`` input)."""
    from reliable_amqp._spool._codec import CodecError, decode

    record: dict[str, Any] = {}
    try:
        message = decode(row.record, row.body)
    except CodecError as exc:
        raise UsageError(f"failed row {row.id} cannot be read: {exc}") from None
    try:
        record["body"] = row.body.decode("utf-8")
    except UnicodeDecodeError:
        record["body"] = base64.b64encode(row.body).decode("ascii")
        record["body_encoding"] = "base64"
    record["exchange"] = message.exchange
    record["routing_key"] = message.routing_key
    record["mandatory"] = message.mandatory
    record.update(set_properties(message))  # type: ignore[arg-type]
    record[ERROR_FIELD] = {
        "type": "OutboxFailed",
        "reason": row.reason,
        "attempts": row.attempts,
        "key": row.key,
        "failed_at": dt.datetime.fromtimestamp(row.failed_at, dt.timezone.utc).isoformat(),
    }
    return record


def _safe_db(db: str) -> str:
    """The DSN without its password."""
    if "://" not in db or "@" not in db:
        return db
    scheme, rest = db.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}{':***' if ':' in creds else ''}@{host}"
