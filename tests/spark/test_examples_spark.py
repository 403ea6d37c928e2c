"""The Spark examples run as written (each starts its own local SparkSession) and exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.spark import CONNECT_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = ["spark_sink.py", "spark_datasource.py"]

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.slow]


@pytest.mark.parametrize("name", SCRIPTS)
def test_spark_example_runs(name: str, amqp_url: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        check=False,
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if k not in CONNECT_ENV},
            "AMQP_URL": amqp_url,
            "PYSPARK_PYTHON": sys.executable,
        },
        cwd=tmp_path,  # examples must not depend on the working directory
        timeout=240,
    )
    assert result.returncode == 0, (
        f"{name} exited {result.returncode}\n--- stdout\n{result.stdout}\n"
        f"--- stderr\n{result.stderr[-4000:]}"
    )
    assert "confirmed" in result.stdout
    if name == "spark_datasource.py":  # the driver-side commits report their totals
        assert "amqp: 1000 rows confirmed from 2 partitions" in result.stderr
        assert "amqp: micro-batch 2: 100 rows confirmed from 1 partition " in result.stderr
