"""examples/spark_stream_pipeline.py runs as written (its own local SparkSession) and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.spark import CONNECT_ENV

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "spark_stream_pipeline.py"

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.slow]


def test_stream_pipeline_example_runs(amqp_url: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        check=False,
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if k not in CONNECT_ENV},
            "AMQP_URL": amqp_url,
            "PYSPARK_PYTHON": sys.executable,
        },
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "table: 1200 orders (1200 distinct), 120 above 900" in result.stdout
    assert "derived events confirmed in large-orders-" in result.stdout
