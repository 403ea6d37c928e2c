"""The spool's benchmark rows run as documented (a short pass)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rows_spool.py"


@pytest.mark.broker
def test_spool_rows_run_and_report_ratios(amqp_url: str) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--count", "300", "--sizes", "12", "--url", amqp_url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AMQP_URL": amqp_url},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "msgs/s" in line]
    assert [line.split("  ")[0] for line in lines] == [
        "reliable_amqp.Publisher (streaming confirms)",
        "reliable_amqp.AsyncPublisher (streaming confirms)",
        "reliable_amqp.Publisher + spool (persist every 10,000)",
        "reliable_amqp.AsyncPublisher + spool (persist every 10,000)",
    ]
