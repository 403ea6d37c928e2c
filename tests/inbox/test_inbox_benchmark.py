"""benchmarks/inbox.py runs as documented (a short pass), so its figures can be reproduced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "inbox.py"


def test_the_inbox_benchmark_reports_each_way_on_postgresql_and_sqlite() -> None:
    """Each way's rate and its ratio to the bare transaction, as docs/inbox.md quotes them."""
    result = subprocess.run(
        [
            *(sys.executable, str(BENCH), "--messages", "40", "--rounds", "1"),
            *("--only", "postgresql,sqlite", "--sqlite-synchronous", "NORMAL", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["database"] for r in rows] == ["postgresql", "sqlite (WAL, NORMAL)"]
    pg, sqlite = rows
    # PostgreSQL adds the pool (docs/inbox.md's pattern) and a connection per message
    assert set(pg["per_s"]) == {"plain", "claim", "handler", "pool", "connect"}
    assert set(pg["ratio"]) == {"claim", "handler", "pool", "connect"}
    assert set(sqlite["per_s"]) == {"plain", "claim", "handler"}
    assert set(sqlite["ratio"]) == {"claim", "handler"}
    for row in rows:
        assert all(rate > 0 for rate in row["per_s"].values())
