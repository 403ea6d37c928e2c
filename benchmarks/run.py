"""The benchmark: every way of publishing, side by side in one run.

    bash scripts/dev.sh bench                 # 20,000 messages, 12 B and 1 KiB bodies
    bash scripts/dev.sh bench --count 5000    # quicker
    bash scripts/dev.sh bench --only sync     # sync rows only (also: async, spool, spark, consume)
    bash scripts/dev.sh bench --repeat 1      # one pass (default 3; rows report the median)

Each row publishes persistent messages to a fresh durable queue on the local broker
($AMQP_URL), and starts only once the broker is idle again (benchmarks/broker_idle.py: the
previous row's queue is gone and the broker's CPU quiet). Every row runs --repeat times, the
passes interleaved (each pass runs every row once), and reports its median rate and its median
client CPU per message (this process's CPU time over the timed part, every thread, divided by
the messages); ratios are of medians within the run, so they compare like with like. The last
row is the broker's own ceiling: pre-encoded frames, no client work.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import rows_sync
from broker_idle import wait_idle

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        print(f"({module} unavailable: {exc})", file=sys.stderr)
        return None


def one_pass(url: str, count: int, body: bytes, groups: set[str]) -> list[dict[str, Any]]:
    """Every row once, in table order (the broker's ceiling last)."""
    rows: list[dict[str, Any]] = []
    if "sync" in groups:
        for key, fn in rows_sync.ROWS.items():
            if key != "ceiling":
                wait_idle()
                rows.append(fn(url, count, body))
    if "async" in groups and (mod := _optional("rows_async")) is not None:
        rows += mod.rows(url, count, body, before_row=wait_idle)
    if "spool" in groups and (mod := _optional("rows_spool")) is not None:
        wait_idle()
        rows += mod.rows(url, count, body)
    if rows:
        wait_idle()
        rows.append(rows_sync.broker_ceiling(url, count, body))
    return rows


def run_size(
    url: str, count: int, size: int, groups: set[str], repeat: int
) -> list[dict[str, Any]]:
    """``repeat`` passes over every row; each row reports the median rate of its runs."""
    body = b"x" * size
    runs: dict[str, list[dict[str, Any]]] = {}
    for n in range(repeat):
        print(f" pass {n + 1} of {repeat}", file=sys.stderr)
        for row in one_pass(url, count, body, groups):
            runs.setdefault(row["name"], []).append(row)
            print(
                f"  {row['name']:<60} {row['rate']:>10,.0f} msgs/s {row['cpu_us']:7.1f} us/msg",
                file=sys.stderr,
            )
    rows = []
    for name, results in runs.items():
        rates = sorted(r["rate"] for r in results)
        rows.append(
            {
                "name": name,
                "msgs": count,
                "body_bytes": size,
                "rate": statistics.median(rates),
                "runs": rates,
                "cpu_us": statistics.median(r["cpu_us"] for r in results),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Median rates, their spread, and ratios of medians within this run."""
    by_name = {r["name"]: r["rate"] for r in rows}
    base = by_name.get("pika, no confirms")
    blocking = by_name.get("pika, BlockingChannel.confirm_delivery()")
    ceiling = by_name.get(rows_sync.CEILING)
    aio_confirm = next((r["rate"] for r in rows if "publisher_confirms=True" in r["name"]), None)
    aio_plain = next((r["rate"] for r in rows if r["name"] == "aio-pika, no confirms"), None)
    lines = [
        f"{'row':<60} {'msgs/s':>8} {'(min-max)':>15} {'vs no-confirm':>13} "
        f"{'vs blocking':>11} {'of ceiling':>10} {'client CPU':>10}"
    ]
    for r in rows:
        spread = f"{min(r['runs']) / 1000:.1f}k-{max(r['runs']) / 1000:.1f}k"
        vs_base = f"{r['rate'] / base:.2f}x" if base else "-"
        vs_block = f"{r['rate'] / blocking:.1f}x" if blocking else "-"
        of_ceiling = f"{r['rate'] / ceiling:.0%}" if ceiling else "-"
        lines.append(
            f"{r['name']:<60} {r['rate']:>8,.0f} {spread:>15} {vs_base:>13} {vs_block:>11} "
            f"{of_ceiling:>10} {r['cpu_us']:>7.1f} us"
        )
    publisher = by_name.get("reliable_amqp.Publisher (streaming confirms)")
    async_publisher = by_name.get("reliable_amqp.AsyncPublisher (streaming confirms)")
    for r in rows:
        if r["name"].endswith(", mandatory=False"):
            default = by_name.get(r["name"].removesuffix(", mandatory=False"))
            if default:
                lines.append(
                    f"  {r['name'].removesuffix(', mandatory=False')} (mandatory, the "
                    f"default): {default / r['rate']:.2f}x the rate with mandatory=False"
                )
    for r in rows:
        if "spool" in r["name"]:
            plain = async_publisher if "Async" in r["name"] else publisher
            if plain:
                lines.append(f"  {r['name']}: {r['rate'] / plain:.2f}x the same publisher without")
    rows_async_name = "reliable_amqp.AsyncPublisher (streaming confirms)"
    if aio_confirm and aio_plain:
        for r in rows:
            if r["name"] == rows_async_name:
                lines.append(
                    f"  AsyncPublisher: {r['rate'] / aio_confirm:.2f}x aio-pika confirms, "
                    f"{r['rate'] / aio_plain:.2f}x aio-pika without confirms"
                )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument(
        "--repeat", type=int, default=3, help="passes over every row; rows report the median"
    )
    parser.add_argument("--sizes", default="12,1024", help="body sizes in bytes, comma separated")
    parser.add_argument(
        "--only",
        default="sync,async,spool,spark,consume",
        help="groups: sync,async,spool,spark,consume (benchmarks/consume.py)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    groups = set(args.only.split(","))
    everything: list[dict[str, Any]] = []
    sizes = args.sizes.split(",") if groups & {"sync", "async", "spool"} else []
    for size in (int(s) for s in sizes):
        print(
            f"{args.count:,} persistent messages of {size} B to a durable queue:", file=sys.stderr
        )
        rows = run_size(args.url, args.count, size, groups, args.repeat)
        everything.extend(rows)
        if not args.json:
            print(
                f"\n== {args.count:,} messages, {size} B bodies, median of {args.repeat} passes =="
            )
            print(table(rows))
    if "spark" in groups and (mod := _optional("rows_spark")) is not None:
        spark_rows = mod.rows(args.url)
        everything.extend(spark_rows)
        if not args.json:
            print("\n== Spark sink: 200,000 rows, 2 partitions (vs publish_many of the size) ==")
            for r in spark_rows:
                print(f"{r['name']:<60} {r['rate']:>10,.0f} rows/s {r['vs_publisher']:>7.2f}x")
    if "spark" in groups and (mod := _optional("rows_spark_read")) is not None:
        read_rows = mod.rows(args.url)
        everything.extend(read_rows)
        if not args.json:
            print("\n== Spark read: one stream of 200,000 messages (vs one pika consumer) ==")
            print(mod.table(read_rows))
    if "consume" in groups and (mod := _optional("consume")) is not None:
        print(f"consume: {mod.COUNT:,} messages a row, prefetch {mod.PREFETCH}:", file=sys.stderr)
        consume_rows = mod.run(
            args.url, list(mod.ROWS), mod.COUNT, 12, prefetch=mod.PREFETCH, repeat=args.repeat
        )
        everything.extend(consume_rows)
        if not args.json:
            print()
            print(
                mod.table(
                    consume_rows,
                    count=mod.COUNT,
                    size=12,
                    prefetch=mod.PREFETCH,
                    repeat=args.repeat,
                )
            )
    if args.json:
        print(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
