"""The Spark examples run as written and exit 0: each starts its own local SparkSession, in a
process that is not this one's (tests/spark/examples_runner.py runs the three in one child, one
after another, on the JVM the first one started: two JVM starts fewer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.spark import CONNECT_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUNNER = Path(__file__).with_name("examples_runner.py")
#: spark_datasource.py first: it sets a variable for its Python workers, which take the
#: environment the JVM started with (examples_runner.py)
SCRIPTS = ["spark_datasource.py", "spark_sink.py", "spark_stream_pipeline.py"]

pytestmark = [pytest.mark.spark, pytest.mark.broker, pytest.mark.slow]


def _split(text: str) -> dict[str, tuple[int | None, str]]:
    """Each example's (exit code or None when it never ended, output) from the runner's output."""
    runs: dict[str, tuple[int | None, str]] = {}
    parts = re.split(r"^=== reliable-amqp example runner: (start|exit) (\S+)(?: (-?\d+))?\n", text,
                     flags=re.M)  # fmt: skip
    for i in range(1, len(parts) - 3, 4):
        kind, name, code, after = parts[i : i + 4]
        if kind == "start":
            runs[name] = (None, after)
        else:
            runs[name] = (int(code), runs.get(name, (None, ""))[1])
    return runs


@pytest.fixture(scope="module")
def runs(
    amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int | None, str, str]]:
    """Every example's (exit code, stdout, stderr), run once for the module."""
    result = subprocess.run(
        [sys.executable, str(RUNNER), *(str(EXAMPLES / name) for name in SCRIPTS)],
        check=False,
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if k not in CONNECT_ENV},
            "AMQP_URL": amqp_url,
            "PYSPARK_PYTHON": sys.executable,
        },
        cwd=tmp_path_factory.mktemp(
            "examples"
        ),  # examples must not depend on the working directory
        timeout=600,
    )
    out, err = _split(result.stdout), _split(result.stderr)
    tail = f"runner exited {result.returncode}\n--- stderr\n{result.stderr[-4000:]}"
    return {
        name: (out.get(name, (None, ""))[0], out.get(name, (None, tail))[1],
               err.get(name, (None, tail))[1])
        for name in SCRIPTS
    }  # fmt: skip


def _ran(runs: dict[str, tuple[int | None, str, str]], name: str) -> tuple[str, str]:
    code, stdout, stderr = runs[name]
    assert code == 0, f"{name} exited {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr[-4000:]}"
    return stdout, stderr


@pytest.mark.parametrize("name", ["spark_sink.py", "spark_datasource.py"])
def test_spark_example_runs(name: str, runs: dict[str, tuple[int | None, str, str]]) -> None:
    stdout, stderr = _ran(runs, name)
    assert "confirmed" in stdout
    if name == "spark_datasource.py":  # the driver-side commits report their totals
        assert "amqp: 1000 rows confirmed from 2 partitions" in stderr
        assert "amqp: micro-batch 2: 100 rows confirmed from 1 partition " in stderr


def test_stream_pipeline_example_runs(runs: dict[str, tuple[int | None, str, str]]) -> None:
    stdout, _ = _ran(runs, "spark_stream_pipeline.py")
    assert "table: 1200 orders (1200 distinct), 120 above 900" in stdout
    assert "derived events confirmed in large-orders-" in stdout
