"""The benchmark: every way of publishing, side by side in one run.

    bash scripts/dev.sh bench                 # 20,000 messages, 12 B and 1 KiB bodies
    bash scripts/dev.sh bench --count 5000    # quicker
    bash scripts/dev.sh bench --only sync     # sync rows only (also: async, spark)

Each row publishes persistent messages to a fresh durable queue on the local broker
($AMQP_URL). Ratios are computed within the run, so they compare like with like.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import rows_sync

URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        print(f"({module} unavailable: {exc})", file=sys.stderr)
        return None


def run_size(url: str, count: int, size: int, groups: set[str]) -> list[dict[str, Any]]:
    body = b"x" * size
    rows: list[dict[str, Any]] = []
    if "sync" in groups:
        for fn in rows_sync.ROWS.values():
            rows.append(fn(url, count, body))
            print(f"  {rows[-1]['name']:<52} {rows[-1]['rate']:>10,.0f} msgs/s", file=sys.stderr)
    if "async" in groups and (mod := _optional("rows_async")) is not None:
        for row in mod.rows(url, count, body):
            rows.append(row)
            print(f"  {row['name']:<52} {row['rate']:>10,.0f} msgs/s", file=sys.stderr)
    for row in rows:
        row["body_bytes"] = size
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    by_name = {r["name"]: r["rate"] for r in rows}
    base = by_name.get("pika, no confirms")
    blocking = by_name.get("pika, BlockingChannel.confirm_delivery()")
    aio_confirm = next((r["rate"] for r in rows if "publisher_confirms=True" in r["name"]), None)
    aio_plain = next((r["rate"] for r in rows if r["name"] == "aio-pika, no confirms"), None)
    lines = [f"{'row':<52} {'msgs/s':>10} {'vs pika no-confirm':>19} {'vs pika blocking':>17}"]
    for r in rows:
        vs_base = f"{r['rate'] / base:.2f}x" if base else "-"
        vs_block = f"{r['rate'] / blocking:.1f}x" if blocking else "-"
        lines.append(f"{r['name']:<52} {r['rate']:>10,.0f} {vs_base:>19} {vs_block:>17}")
    if aio_confirm and aio_plain:
        for r in rows:
            if r["name"].startswith("reliable_amqp.AsyncPublisher"):
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
    parser.add_argument("--sizes", default="12,1024", help="body sizes in bytes, comma separated")
    parser.add_argument("--only", default="sync,async,spark", help="groups: sync,async,spark")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--url", default=URL)
    args = parser.parse_args()
    groups = set(args.only.split(","))
    everything: list[dict[str, Any]] = []
    for size in (int(s) for s in args.sizes.split(",")):
        print(
            f"{args.count:,} persistent messages of {size} B to a durable queue:", file=sys.stderr
        )
        rows = run_size(args.url, args.count, size, groups)
        everything.extend(rows)
        if not args.json:
            print(f"\n== {args.count:,} messages, {size} B bodies ==")
            print(table(rows))
    if "spark" in groups and (mod := _optional("rows_spark")) is not None:
        spark_rows = mod.rows(args.url)
        everything.extend(spark_rows)
        if not args.json:
            print("\n== Spark sink: 200,000 rows, 256 B bodies, 2 partitions ==")
            standalone = next((r["rate"] for r in spark_rows if "Publisher" in r["name"]), None)
            for r in spark_rows:
                ratio = f"{r['rate'] / standalone:.2f}x" if standalone else "-"
                print(f"{r['name']:<52} {r['rate']:>10,.0f} rows/s {ratio:>8}")
    if args.json:
        print(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
