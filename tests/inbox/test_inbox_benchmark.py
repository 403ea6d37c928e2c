"""benchmarks/inbox.py runs as documented (a short pass), so its figures can be reproduced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "inbox.py"


def test_the_inbox_benchmark_reports_each_way_on_postgresql_and_sqlite() -> None:
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
    for row in rows:
        assert set(row["per_s"]) == {"plain", "claim", "handler"}
        assert all(rate > 0 for rate in row["per_s"].values())
        assert set(row["ratio"]) == {"claim", "handler"}
