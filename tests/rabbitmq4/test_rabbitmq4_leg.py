"""The contract subset against RabbitMQ 4: the broker users run in 2026, beside the 3.10 one.

A disposable RabbitMQ 4 node (Debian testing's package in the cached root that
``scripts/rabbitmq4.sh`` builds, see tests/harness/rabbitmq4.py) stands in for the shared broker:
the broker tests (``-m broker``) of the subset the version matrix runs
(:data:`matrix.test_versions.SUBSET`) run in a subprocess of the main venv with
``AMQP_TEST_URL``/``AMQP_TEST_PORT`` pointing at it, and with the fault fixtures' disposable node
a RabbitMQ 4 node too (kill -9, restart, memory alarm). The subset's other tests (the fake peer's,
the frame encoders', 125 of 240) need no broker: in this venv they are the suite's own run again,
and are left out. The versions it ran with (broker as it announces itself, Erlang, client
libraries) are printed at the end of the run, as the matrix legs print theirs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.fixtures import DISPOSABLE_BROKER_ENV
from harness.rabbitmq4 import ROOT_ENV, Rabbitmq4Node, ensure_root, versions
from harness.rabbitmq4_fixtures import broker_versions
from matrix.test_versions import _VERSIONS, PACKAGES, LegResult, _clean_env, run_subset
from support.run_summary import add_summary

pytestmark = [
    pytest.mark.broker,
    pytest.mark.slow,
    pytest.mark.rabbitmq_only(reason="runs RabbitMQ 4 nodes of its own (scripts/rabbitmq4.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]
#: a hard bound on the run (about 60 s alone)
TIMEOUT = 900


def test_contract_subset_passes_on_rabbitmq4(
    request: pytest.FixtureRequest, tmp_path: Path, rmq4: Rabbitmq4Node
) -> None:
    result = LegResult("rabbitmq4")
    started = time.monotonic()
    node = rmq4  # the directory's node (conftest.py)
    announced = broker_versions(node.url)
    assert announced["product"] == "RabbitMQ" and announced["version"].startswith("4."), announced
    env = {
        **_clean_env(),
        "AMQP_TEST_URL": node.url,
        "AMQP_TEST_HOST": "127.0.0.1",
        "AMQP_TEST_PORT": str(node.port),
        DISPOSABLE_BROKER_ENV: "rabbitmq4",
        ROOT_ENV: str(ensure_root()),
        "RELIABLE_AMQP_NO_SKIP": "1",
    }
    probe = subprocess.run(
        [sys.executable, "-c", _VERSIONS, *PACKAGES],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    installed = versions()
    result.versions = {
        "rabbitmq": f"{announced['version']} (Debian {installed['rabbitmq-server']})",
        "erlang": announced.get("platform", "?"),
        **json.loads(probe.stdout),
    }
    junit = tmp_path / "rabbitmq4.xml"
    # only the subset's broker tests: the others (the fake peer's, the frame encoders') run
    # this venv's code against no broker, exactly as the suite itself runs them
    run_subset(sys.executable, env, junit, TIMEOUT, result, marks="broker")
    result.seconds = time.monotonic() - started
    add_summary(request, "rabbitmq 4", result.headline().replace("matrix ", "", 1))
    tail = result.output[-8000:]
    assert result.counts.get("passed", 0) > 0, f"no test passed on RabbitMQ 4\n{tail}"
    assert result.returncode == 0, f"the contract subset failed on RabbitMQ 4:\n{tail}"
