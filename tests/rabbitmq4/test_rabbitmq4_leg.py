"""The contract subset against RabbitMQ 4: the broker users run in 2026, beside the 3.10 one.

A disposable RabbitMQ 4 node (Debian testing's package in the cached root that
``scripts/rabbitmq4.sh`` builds, see tests/harness/rabbitmq4.py) stands in for the shared broker:
the subset the version matrix runs (:data:`matrix.test_versions.SUBSET`) runs in a subprocess of
the main venv with ``AMQP_TEST_URL``/``AMQP_TEST_PORT`` pointing at it, and with the fault
fixtures' disposable node a RabbitMQ 4 node too (kill -9, restart, memory alarm). The versions
it ran with (broker as it announces itself, Erlang, client libraries) are printed at the end of
the run, as the matrix legs print theirs. About 70 s.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
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


#: the leg started beside the suite (``start_early``), if it was
_EARLY: list[Future[LegResult]] = []
_EARLY_THREADS: list[tuple[ThreadPoolExecutor, Path]] = []


def start_early(items: list[pytest.Item]) -> None:
    """Start the leg once collection is done (tests/conftest.py), so that it runs beside the
    rest of the suite instead of inside it: after the version matrix's legs (they start at the
    same moment, four at a time), so that no more than four legs ever run at once."""
    if _EARLY or not any(item.path.name == Path(__file__).name for item in items):
        return
    # the matrix's legs, as pytest imported their module (not matrix.test_versions, a second
    # copy of it that the import above made)
    matrix = next(
        (
            getattr(item, "module", None)
            for item in items
            if (item.path.parent.name, item.path.name) == ("matrix", "test_versions.py")
        ),
        None,
    )
    before: list[Future[LegResult]] = list(getattr(matrix, "_EARLY", {}).values())

    workdir = Path(tempfile.mkdtemp(prefix="reliable-amqp-rabbitmq4-"))
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rabbitmq4-leg")
    _EARLY_THREADS.append((pool, workdir))

    def after_the_matrix() -> LegResult:
        wait(before)
        return run_leg(workdir)

    _EARLY.append(pool.submit(after_the_matrix))


def finish_early() -> None:
    """At the session's end: the leg is not left running unwaited."""
    while _EARLY_THREADS:
        pool, workdir = _EARLY_THREADS.pop()
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(workdir, ignore_errors=True)
    _EARLY.clear()


def test_contract_subset_passes_on_rabbitmq4(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    result = _EARLY[0].result() if _EARLY else run_leg(tmp_path)
    add_summary(request, "rabbitmq 4", result.headline().replace("matrix ", "", 1))
    tail = result.output[-8000:]
    announced = result.versions.get("rabbitmq", "")
    assert announced.startswith("4."), f"not a RabbitMQ 4 node: {announced!r}\n{tail}"
    assert result.counts.get("passed", 0) > 0, f"no test passed on RabbitMQ 4\n{tail}"
    assert result.returncode == 0, f"the contract subset failed on RabbitMQ 4:\n{tail}"


def run_leg(workdir: Path) -> LegResult:
    """The contract subset against a RabbitMQ 4 node of its own (its result, to be asserted)."""
    result = LegResult("rabbitmq4")
    started = time.monotonic()
    with Rabbitmq4Node() as node:
        announced = broker_versions(node.url)
        if announced["product"] != "RabbitMQ" or not announced["version"].startswith("4."):
            result.output = f"the node announced itself as {announced}"
            result.versions = {"rabbitmq": str(announced.get("version", "?"))}
            return result
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
        junit = workdir / "rabbitmq4.xml"
        run_subset(sys.executable, env, junit, TIMEOUT, result)
    result.seconds = time.monotonic() - started
    return result
