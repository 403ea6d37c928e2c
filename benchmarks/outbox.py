"""The transactional outbox (issue 29): the relay against publish_many, its memory, the latency
of an idle relay, what add() costs a writer, NOTIFY and the writers' commits, two relays.

    bash scripts/dev.sh run python benchmarks/outbox.py                     # 1,000,000-row backlog
    bash scripts/dev.sh run python benchmarks/outbox.py --backlog 200000    # quicker
    bash scripts/dev.sh run python benchmarks/outbox.py --only latency,writer --json
    bash scripts/dev.sh run python benchmarks/outbox.py --only mariadb,stacks
    bash scripts/dev.sh run python benchmarks/outbox.py --quick             # seconds, tiny sizes

Everything runs against the real PostgreSQL ($OUTBOX_PG, default postgresql://postgres@127.0.0.1:
5432; a database of its own, dropped after) and the local broker ($AMQP_URL). Messages go to a
durable direct exchange of the run's own; each measured row binds a fresh durable lazy queue to
it (the broker keeps the backlog on its disk), deleted after. Bodies are ``--size`` bytes
(default 200), persistent, mandatory.

- **drain**: ``--backlog`` rows are written once through ``Outbox.add_many`` (10,000 a
  transaction; its rate is reported) into a template table, copied into a fresh outbox table,
  and drained by one relay in a process of its own (``OutboxRelay.run(until_empty=True)``); the
  same messages are published by ``Publisher.publish_many`` (1,000 a call) in a process of its
  own. Both are timed the same way, from the "go" given to the ready process to the moment the
  queue holds every message (passive declares every 20 ms). Client CPU per message is the
  process's ``time.process_time()`` over its run; the PostgreSQL backends' (the relay's two
  sessions, found through pg_stat_activity) and the broker's (``beam.smp``) through psutil; the
  machine's busy share of its cores too. The broker's ceiling (raw_ceiling.py:
  pre-encoded frames, no client work) closes the table.
- **rss**: the relay's resident memory, sampled every 20 ms (psutil), at
  a ``--small-backlog`` (default a tenth of ``--backlog``) and at ``--backlog`` (the drain's).
- **relays**: two relays (two processes) against one on the same ``--backlog`` rows.
- **latency**: an idle relay, and writer threads committing ``--rate`` transactions a second
  (one ``add()`` each) for ``--latency-seconds``: commit-to-confirm as the relay measures it
  (``relay.stats()``: from the row's ``created_at``, stamped in ``add()``, to the relay taking
  the broker's confirm) and commit-to-delivery as a consumer of the queue sees it (from
  ``commit()`` returning in the writer to the delivery, by message id). With NOTIFY, and without
  (the relay then finds rows by polling, every ``poll_interval``: 1 s).
- **writer**: one connection, ``add()`` against a plain INSERT of the same row (the same columns
  and values, prepared), NOTIFY on and off, one row and 100 rows a transaction.
- **commits**: 1 and ``--writers`` writer processes committing one ``add()`` a transaction as
  fast as they can for ``--commit-seconds``, NOTIFY on and off (a LISTEN session open, as an
  idle relay's is), two rounds interleaved: whether NOTIFY's lock at commit serialises the
  writers, seen in their commit rate and, directly, in how often their sessions wait for that
  lock (pg_stat_activity sampled every 10 ms).
- **sqlite**, **mariadb**: a ``--sqlite-backlog`` drained from a SQLite file, and a
  ``--mariadb-backlog`` from MariaDB ($OUTBOX_MYSQL, default mysql://root@127.0.0.1:3306; a
  database of its own, dropped after) through PyMySQL, each written through
  ``Outbox.add_many`` and drained as the drain section's row is (the same code), against
  ``publish_many`` of the same number of messages in the same run (measured once for each
  number and shared by the rows of that size). MariaDB's CPU is the whole ``mariadbd``
  process's (its performance_schema is off: no CPU per session), other sessions' work included.
- **stacks**: the writer on each application stack (psycopg, SQLAlchemy ``Session`` over
  psycopg, ``AsyncSession`` over asyncpg, a bare asyncpg connection, Django's
  ``transaction.atomic()``, all on PostgreSQL; PyMySQL on MariaDB; sqlite3): ``--writer-txns``
  transactions of one ``add()`` each against as many of a plain INSERT of the same row (the same
  columns and values, a fresh message id and time) through the same connection in the same
  transaction shape, in rounds interleaved; the extra client CPU a row (``time.process_time``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


import rows_outbox
import rows_outbox_writers
from outbox_children import child_main
from outbox_harness import BROKER, PG, SECTIONS, URL, Broker, Database, Row, load_average
from rows_outbox import Context
from rows_outbox_writers import COMMIT_ROUNDS, ROUNDS

# --- printing ---------------------------------------------------------------------------------


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def print_results(ctx: Context) -> None:
    results, args = ctx.results, ctx.args
    maria = f", MariaDB {ctx.maria.version()}" if ctx.maria else ""
    print(
        f"\n== outbox: {args.size} B bodies, persistent, mandatory, one durable lazy queue "
        f"(PostgreSQL {server_version(ctx.db)}{maria}, {os.cpu_count()} cores) =="
    )
    print(f"library: {library_source()}")
    print(f"load average at the start: {ctx.load}; sections took {ctx.took} (seconds)")
    for key, title in (("drain", f"drain: a {args.backlog:,}-row backlog, one relay"),
                       ("relays", "two relays against one"),
                       ("sqlite", f"SQLite: a {args.sqlite_backlog:,}-row backlog, one relay"),
                       ("mariadb", f"MariaDB (PyMySQL): a {args.mariadb_backlog:,}-row backlog, "
                        "one relay")):  # fmt: skip
        if key not in results:
            continue
        print(f"\n-- {title} --")
        print(
            f"{'row':<62} {'msgs':>9} {'msgs/s':>8} {'halves':>13} {'ratio':>6} "
            f"{'client CPU':>10} {'DB CPU':>9} {'broker CPU':>10} {'all CPU':>9} {'broker':>6} "
            f"{'machine':>7}"
        )
        for r in results[key]:
            ratio = r.get("vs_publish_many", r.get("vs_one"))
            first, second = r.get("halves") or (None, None)
            halves = f"{fmt(first, ',.0f')}/{fmt(second, ',.0f')}" if first else "-"
            print(
                f"{r['name']:<62} {r['msgs']:>9,} {r['rate']:>8,.0f} {halves:>13} "
                f"{fmt(ratio, '.2f', 'x'):>6} "
                f"{fmt(r.get('cpu_us'), '.1f', ' us'):>10} "
                f"{fmt(r.get('backend_cpu_us'), '.1f', ' us'):>9} "
                f"{fmt(r.get('broker_cpu_us'), '.1f', ' us'):>10} "
                f"{fmt(all_cpu(r), '.1f', ' us'):>9} "
                f"{fmt(r.get('broker_cores'), '.2f'):>6} "
                f"{fmt(r.get('machine_busy', None) and r['machine_busy'] * 100, '.0f', '%'):>7}"
            )
        print(
            "  halves: msgs/s while the queue took its first and its second half; CPU columns: "
            "per message (client: the\n  process's own; DB: PostgreSQL's backends of the "
            "relays, MariaDB's whole mariadbd, SQLite's in the client; broker:\n  beam.smp; "
            "all: the three); broker: cores it used; machine: busy share of all cores"
        )
        relay = next((r for r in results[key] if r["name"].startswith("OutboxRelay")), None)
        plain = next((r for r in results[key] if r["name"].startswith("Publisher")), None)
        relay_cpu = all_cpu(relay) if relay else None
        plain_cpu = all_cpu(plain) if plain else None
        if relay_cpu and plain_cpu:
            print(
                f"  CPU a message, all of it: publish_many {plain_cpu:.1f} us, the relay "
                f"{relay_cpu:.1f} us; on a machine whose cores are all busy the rates "
                f"follow: {plain_cpu / relay_cpu:.2f}x"
            )
        if key == "relays" and len(results[key]) == 2:
            print(f"  2 relays published {results[key][1]['published']} rows each")
    if "rss" in results:
        rows = results["rss"]
        print("\n-- relay memory (its process) --")
        print(f"{'row':<62} {'RSS ready':>10} {'peak VmRSS':>11} {'VmHWM':>9} {'growth':>9}")
        for r in rows:
            print(
                f"{r['name']:<62} {r['rss_ready_mb']:>7.1f} MB {r['rss_peak_mb']:>8.1f} MB "
                f"{r['rss_hwm_mb']:>6.1f} MB {r['rss_peak_mb'] - r['rss_ready_mb']:>+6.1f} MB"
            )
        print("  ready: once imported and built, before run(); growth: peak VmRSS - ready")
        if len(rows) == 2:
            print(f"  peak difference: {rows[1]['rss_peak_mb'] - rows[0]['rss_peak_mb']:+.1f} MB")
    if "latency" in results:
        print(
            f"\n-- commit to confirm: an idle relay, {args.latency_writers} writer threads, "
            f"{args.rate:,} transactions/s of one add() --"
        )
        print(
            f"{'row':<38} {'commits':>8} {'/s':>6} {'confirm p50':>11} {'p99':>9} "
            f"{'delivery p50':>12} {'p99':>9} {'commit p50':>10} {'p99':>8} {'relay CPU':>9} "
            f"{'a message':>9}"
        )
        for r in results["latency"]:
            print(
                f"{r['name']:<38} {r['commits']:>8,} {r['commit_rate']:>6,.0f} "
                f"{fmt(r['confirm_p50_ms'], '.1f', ' ms'):>11} "
                f"{fmt(r['confirm_p99_ms'], '.1f', ' ms'):>9} "
                f"{fmt(r['delivery_p50_ms'], '.1f', ' ms'):>12} "
                f"{fmt(r['delivery_p99_ms'], '.1f', ' ms'):>9} "
                f"{fmt(r['commit_p50_ms'], '.1f', ' ms'):>10} "
                f"{fmt(r['commit_p99_ms'], '.1f', ' ms'):>8} "
                f"{r['relay_cpu_pct']:>8.0f}% "
                f"{r['relay_cpu_us']:>6.0f} us"
            )
        print(
            "  confirm: relay.stats(), from add() (the row's created_at) to the relay taking the "
            "broker's confirm;\n  delivery: a consumer of the queue, from commit() returning in "
            "the writer to the delivery;\n  commit: in the writer, from add() to commit() "
            "returning (part of confirm's figure, not of delivery's);\n  relay CPU: its "
            "process's, in % of one core over its run, and per message (idle time included)"
        )
    if "writer" in results:
        print("\n-- the writer's cost: one connection, rows per transaction as shown --")
        print(
            f"{'row':<28} {'rows/txn':>8} {'txns':>6} {'in statement':>12} {'vs INSERT':>9} "
            f"{'with commit':>11} {'client CPU':>10} {'txns/s':>8}"
        )
        for r in results["writer"]:
            print(
                f"{r['name']:<28} {r['rows_per_txn']:>8} {r['txns']:>6,} "
                f"{r['statement_us']:>9.1f} us {r['extra_us_per_row']:>+6.1f} us "
                f"{r['total_us']:>8.1f} us {r['cpu_us']:>7.1f} us {r['txn_rate']:>8,.0f}"
            )
        print("  per row; in statement: the add() or INSERT calls, the commit excluded")
    if "commits" in results:
        print(
            f"\n-- NOTIFY and concurrent commits: writer processes, one add() a transaction, "
            f"{args.commit_seconds:g} s a round --"
        )
        print(f"{'row':<28} {'commits':>9} {'commits/s':>10} {'(rounds)':>16} {'NOTIFY lock':>11}")
        for r in results["commits"]:
            rounds = "/".join(f"{rate:,.0f}" for rate in r["runs"])
            print(
                f"{r['name']:<28} {r['commits']:>9,} {r['commit_rate']:>10,.0f} {rounds:>16} "
                f"{r['lock_wait']:>10.0%}"
            )
        print(
            f"  {COMMIT_ROUNDS} rounds interleaved, the median; NOTIFY lock: share of the "
            "writers' sampled states (every 10 ms)\n  spent waiting for the lock NOTIFY "
            "takes at commit (pg_stat_activity: Lock, object)"
        )
    if "stacks" in results:
        print(
            "\n-- the writer on each stack: one row a transaction, add() against a plain INSERT "
            "of the same row --"
        )
        print(
            f"{'stack':<34} {'txns':>6} {'add() CPU':>10} {'INSERT CPU':>10} {'extra CPU':>10} "
            f"{'add() txn':>10} {'INSERT txn':>10} {'extra CPU, rounds':>18}"
        )
        for r in results["stacks"]:
            print(
                f"{r['name']:<34} {r['txns']:>6,} {r['add_cpu_us']:>7.1f} us "
                f"{r['plain_cpu_us']:>7.1f} us {r['extra_cpu_us']:>+7.1f} us "
                f"{r['add_txn_us']:>7.0f} us {r['plain_txn_us']:>7.0f} us "
                f"{min(r['extra_runs']):>+6.0f} to {max(r['extra_runs']):>+4.0f} us"
            )
        print(
            f"  per row; CPU: this process's (time.process_time), {ROUNDS} rounds interleaved, "
            "the median; extra: add() CPU - INSERT CPU (of the medians;\n  rounds: the "
            "lowest and highest of the rounds' own); txn: wall time of the whole transaction "
            "(the database's work and\n  the commit's wait included)"
        )


def all_cpu(row: Row) -> float | None:
    """Client, PostgreSQL and broker CPU a message (None when the client's or the broker's is
    not known; PostgreSQL's counts 0 for a row that does not use it)."""
    if row.get("cpu_us") is None or row.get("broker_cpu_us") is None:
        return None
    return float(row["cpu_us"] + (row.get("backend_cpu_us") or 0.0) + row["broker_cpu_us"])


def library_source() -> str:
    """Where reliable_amqp was imported from, and its git commit (with "+changes" when its
    outbox package differs from that commit) when it is a checkout."""
    import reliable_amqp

    src = Path(reliable_amqp.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "outbox"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return str(src)
    return f"{src} at {rev}{' +changes in outbox/' if dirty else ''}"


def server_version(db: Database) -> str:
    with db.connect() as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]).split()[0] if row else "?"


#: each section's function (``section_NAME`` of the rows' modules), in run order
run_section: dict[str, Callable[[Context], None]] = {
    name: getattr(rows_outbox, f"section_{name}", None)
    or getattr(rows_outbox_writers, f"section_{name}")
    for name in SECTIONS
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--backlog", type=int, default=1_000_000, help="rows (1,000,000)")
    parser.add_argument(
        "--small-backlog", type=int, default=0, help="the rss section's smaller backlog "
        "(default: a tenth of --backlog)"
    )  # fmt: skip
    parser.add_argument("--size", type=int, default=200, help="body bytes (200)")
    parser.add_argument(
        "--ceiling-count", type=int, default=200_000, help="messages of the broker-ceiling row"
    )
    parser.add_argument("--rate", type=int, default=500, help="latency: transactions/s (500)")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--latency-writers", type=int, default=4, help="writer threads (4)")
    parser.add_argument(
        "--writer-txns", type=int, default=2000, help="writer, stacks: one-row transactions "
        "(2,000; the writer: a tenth as many of 100 rows)"
    )  # fmt: skip
    parser.add_argument("--writers", type=int, default=8, help="commits: writer processes (8)")
    parser.add_argument("--commit-seconds", type=float, default=5.0)
    parser.add_argument("--sqlite-backlog", type=int, default=200_000)
    parser.add_argument("--mariadb-backlog", type=int, default=200_000)
    parser.add_argument("--only", default=",".join(SECTIONS), help=",".join(SECTIONS))
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, for a smoke test (seconds)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--save", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--url", default=URL)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(json.loads(args.child))
    BROKER["url"] = args.url
    if args.quick:
        args.backlog, args.small_backlog, args.ceiling_count = 3000, 1000, 2000
        args.rate, args.latency_seconds, args.writer_txns = 100, 0.5, 40
        args.writers, args.commit_seconds = 2, 0.2
        args.sqlite_backlog = args.mariadb_backlog = 3000
    sections = args.only.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}")
    db, broker = Database(PG, checkpoint=not args.quick), Broker(args.url)
    ctx = Context(args, db, broker, load=load_average())
    try:
        for section in SECTIONS:
            if section in sections:
                print(f" {section} ...", file=sys.stderr)
                started = time.perf_counter()
                run_section[section](ctx)
                ctx.took[section] = round(time.perf_counter() - started)
                print(f"   {ctx.took[section]} s", file=sys.stderr)
        figures = {**ctx.results, "load": ctx.load, "took": ctx.took}
        if args.save:
            Path(args.save).write_text(json.dumps(figures, indent=2))
        if args.json:
            print(json.dumps(figures, indent=2))
        else:
            print_results(ctx)
    finally:
        if ctx.listener is not None:
            ctx.listener.result()  # its stdin closed: it ends
        if ctx.maria is not None:
            ctx.maria.close()
        db.close()
        broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
