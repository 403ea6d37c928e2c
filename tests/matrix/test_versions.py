"""The contract subset on every supported Python and at both ends of every dependency range.

Each leg is a venv that ``scripts/dev.sh`` builds and caches (``scripts/dev.sh test`` builds them
all, in parallel, before pytest starts; ``scripts/dev.sh venvs LEG`` builds one):

- ``py3.10``, ``py3.13``: ``.[aio,dev]`` with whatever pip resolves there (aio-pika 9 / aiormq 6
  on 3.10, aio-pika 10 / aiormq 7 on 3.13); the main venv is the 3.11 leg;
- ``py3.14``: the same with Debian testing's ``python3.14``, which lives in the RabbitMQ 4 root
  (``scripts/rabbitmq4.sh``): its venv is built and run inside that root (chroot, with the
  checkout and ``/tmp`` bind-mounted), through the launcher ``venv-py3.14/host-python``;
- ``lowest``: Python 3.10 with ``constraints/lowest.txt``, every runtime dependency at its lower
  bound.

No leg installs the outbox's optional stacks (SQLAlchemy, Django, asyncpg, PyMySQL, psycopg):
each leg checks they are missing, imports the library, its CLI and the outbox, and writes through
the outbox on sqlite3, so the matrix shows the library and its non-outbox tests work without them.

Each test runs :data:`SUBSET` inside its venv as a subprocess and asserts it passed with more
than 0 tests; the versions it ran with are printed at the end of the run (terminal summary) and
in each test's output. A missing interpreter fails the leg, it never skips it. The legs run
concurrently (``RELIABLE_AMQP_MATRIX_JOBS``, default 4): each is mostly waiting on sockets. In a
one-process run they start as soon as collection is done, beside the rest of the suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from support.matrix import OPTIONAL, WITHOUT_OPTIONAL
from support.run_summary import add_summary

ROOT = Path(__file__).resolve().parents[2]
MATRIX_DIR = Path(
    os.environ.get("RELIABLE_AMQP_MATRIX_DIR", Path.home() / ".cache" / "reliable-amqp")
)

#: leg name -> what it is (the venv is MATRIX_DIR / f"venv-{leg}")
LEGS = {
    "py3.10": "Python 3.10, newest dependencies pip resolves there",
    "py3.13": "Python 3.13, newest dependencies pip resolves there",
    "py3.14": "Python 3.14 (Debian testing, in the RabbitMQ 4 root), newest dependencies",
    "lowest": "Python 3.10, constraints/lowest.txt (every lower bound)",
}

#: The contract suite (both publishers) and the tests that reach every private hook: confirm,
#: nack, return (test_publisher, adapters), channel close (missing exchange, oversize body, a
#: channel lost), reconnect (cut connections, lent robust connection), connection.blocked
#: (memory alarm), futures and cancellation (CPython hooks), frame encoding (pika, pamqp), and
#: the consumer (pika's connection under its own frame scanner).
SUBSET = (
    "tests/test_publisher.py",
    "tests/adapters",
    "tests/async/test_async_cancellation.py",
    "tests/async/test_async_frames.py",
    "tests/async/test_async_faults.py::test_cut_connection_is_recovered_and_republished",
    "tests/async/test_async_faults.py::test_channel_loss_is_an_event_and_recovers",
    "tests/async/test_async_faults.py::test_lent_robust_connection_recovers_and_republishes",
    "tests/async/test_async_faults.py::test_memory_alarm_pauses_publishing_without_failing",
    "tests/faults/test_sync_faults.py::test_five_connection_cuts_during_one_stream",
    "tests/faults/test_sync_faults.py::test_memory_alarm_pauses_publishing_without_failing",
    # the consumer: its own frame and header decoding (the same on every leg: pamqp 3.3 reads
    # a negative decimal wrong, this decoder does not) and its contract against the broker
    "tests/core/test_consume_core.py",
    "tests/test_consumer.py",
)

PACKAGES = ("pika", "aio-pika", "aiormq", "pamqp", "tenacity", "sortedcontainers")

#: a hard bound on one leg (75 s alone, about 200 s with the three legs at once on 2 cores; the
#: suite's own 300 s per test would cut a leg that waits for the others, hence its own timeout)
LEG_TIMEOUT = 900

#: run as ``python -c _VERSIONS PACKAGE...``: prints {"python": ..., PACKAGE: version, ...}
_VERSIONS = """
import importlib.metadata as m, json, platform, sys
out = {"python": platform.python_version()}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = "missing"
print(json.dumps(out))
"""

pytestmark = [
    pytest.mark.broker,
    pytest.mark.slow,
    # the subset holds fault tests on disposable RabbitMQ nodes (kill -9, rabbitmqctl alarms)
    pytest.mark.rabbitmq_only(reason="the subset runs fault tests on RabbitMQ nodes of its own"),
]


@dataclass
class LegResult:
    """What one leg's run found."""

    leg: str
    versions: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    output: str = ""
    #: what the library's import and an outbox write on sqlite3 printed without OPTIONAL
    without_optional: str = ""

    def headline(self) -> str:
        """One line: versions, counts, time."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items() if v) or "no tests"
        return f"matrix {self.leg}: {versions}: {counts} in {self.seconds:.0f} s"


def _clean_env() -> dict[str, str]:
    """This process's environment without what would leak into the leg: the venv, Spark, and
    pytest's own (PYTEST_ADDOPTS, an xdist worker's PYTEST_XDIST_*: the leg runs its own pytest)."""
    drop = ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")
    return {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("SPARK_", "PYSPARK_", "COV_CORE", "PYTEST_"))
    }


def _counts(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    if suite.tag == "testsuites":
        suite = suite[0]
    total = int(suite.get("tests", 0))
    failures, errors = int(suite.get("failures", 0)), int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return {
        "passed": total - failures - errors - skipped,
        "failed": failures,
        "errors": errors,
        "skipped/xfailed": skipped,
    }


def run_subset(
    python: str,
    env: dict[str, str],
    junit: Path,
    timeout: float,
    result: LegResult,
    *,
    marks: str | None = None,
) -> None:
    """Run the contract subset with ``python`` and ``env`` (only its tests matching ``marks``,
    a ``-m`` expression, when given); its exit code, output and counts (read from ``junit``) go
    into ``result``."""
    command = [python, "-m", "pytest", *SUBSET, "-q", "-p", "no:cacheprovider", "-rfE"]
    if marks is not None:
        command += ["-m", marks]
    try:
        run = subprocess.run(
            [*command, f"--junitxml={junit}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        result.returncode, result.output = run.returncode, run.stdout + run.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        result.output = f"the subset did not finish within {timeout} s\n{out}"
    if junit.exists():
        result.counts = _counts(junit)


def leg_python(leg: str) -> Path:
    """The leg's interpreter as this machine runs it: the venv's python, or for a leg whose
    interpreter lives in the RabbitMQ 4 root, the launcher that runs it there."""
    venv = MATRIX_DIR / f"venv-{leg}"
    launcher = venv / "host-python"
    return launcher if launcher.exists() else venv / "bin" / "python"


def run_leg(leg: str, workdir: Path) -> LegResult:
    """Build (or check) the leg's venv, then run the subset in it; never raises."""
    result = LegResult(leg)
    started = time.monotonic()
    env = _clean_env()
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "dev.sh"), "venvs", leg],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if built.returncode != 0:
        result.output = f"scripts/dev.sh venvs {leg} failed:\n{built.stderr[-4000:]}"
        return result
    python = leg_python(leg)
    probe = subprocess.run(
        [str(python), "-c", _VERSIONS, *PACKAGES, *OPTIONAL],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if probe.returncode != 0:
        result.output = f"{python} could not report its versions:\n{probe.stderr[-4000:]}"
        return result
    result.versions = json.loads(probe.stdout)
    without = subprocess.run(
        [str(python), "-c", WITHOUT_OPTIONAL, *OPTIONAL],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
        check=False,
    )
    result.without_optional = (without.stdout + without.stderr).strip()[-4000:]
    run_subset(str(python), env, workdir / f"{leg}.xml", LEG_TIMEOUT, result)
    result.seconds = time.monotonic() - started
    result.failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.output, re.MULTILINE)
    return result


#: the legs :func:`start_early` started, and their pool and work directory
_EARLY: dict[str, Future[LegResult]] = {}
_EARLY_POOL: list[tuple[ThreadPoolExecutor, Path]] = []


def _jobs() -> int:
    return max(1, int(os.environ.get("RELIABLE_AMQP_MATRIX_JOBS", "4")))


def start_early(items: list[pytest.Item]) -> None:
    """Start the selected legs as soon as collection is done (``pytest_collection_finish`` in
    tests/conftest.py), so that they run beside the rest of the suite instead of after it:
    each leg is mostly waiting on sockets, and the longest of them takes about two minutes."""
    selected = _selected_legs(items)
    if not selected or _EARLY:
        return
    workdir = Path(tempfile.mkdtemp(prefix="reliable-amqp-matrix-"))
    pool = ThreadPoolExecutor(max_workers=_jobs(), thread_name_prefix="matrix-leg")
    _EARLY_POOL.append((pool, workdir))
    _EARLY.update({leg: pool.submit(run_leg, leg, workdir) for leg in LEGS if leg in selected})


def finish_early() -> None:
    """At the session's end: no leg is left running unwaited (an interrupted run cancels the
    legs not yet started and waits for the others, each bounded by :data:`LEG_TIMEOUT`)."""
    while _EARLY_POOL:
        pool, workdir = _EARLY_POOL.pop()
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(workdir, ignore_errors=True)
    _EARLY.clear()


@pytest.fixture(scope="module")
def legs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, Future[LegResult]]]:
    """Every selected leg, started at once in threads (already at the end of collection, by
    :func:`start_early`, when the run has one process); each test waits for its own (``-k
    py3.14`` runs that leg alone)."""
    if _EARLY:
        yield dict(_EARLY)
        return
    workdir = tmp_path_factory.mktemp("matrix")
    selected = _selected_legs(request.session.items)
    with ThreadPoolExecutor(max_workers=_jobs()) as pool:
        yield {leg: pool.submit(run_leg, leg, workdir) for leg in LEGS if leg in selected}


def _selected_legs(items: list[pytest.Item]) -> set[str]:
    legs: set[str] = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "leg" in callspec.params:
            legs.add(callspec.params["leg"])
    return legs


def test_lowest_constraints_pin_every_lower_bound() -> None:
    """constraints/lowest.txt pins each runtime range (core and aio) at its lower bound."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # the dev extra brings tomli there
        # tomli is installed only on Python 3.10 venvs (mypy checks as 3.10 from any venv)
        import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["aio"]]
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints" / "lowest.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    for requirement in map(Requirement, declared):
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        upper = [s.version for s in requirement.specifier if s.operator == "<"]
        assert lower and upper, f"{requirement} needs a lower and an upper bound"
        assert requirement.name in pins, f"constraints/lowest.txt does not pin {requirement.name}"
        assert Version(pins[requirement.name]) == Version(lower[0]), (
            f"{requirement.name}: lowest.txt pins {pins[requirement.name]}, "
            f"pyproject's lower bound is {lower[0]}"
        )


@pytest.mark.parametrize("leg", list(LEGS))
@pytest.mark.timeout(LEG_TIMEOUT + 120)  # the legs run at once: a leg is bounded by LEG_TIMEOUT
def test_contract_subset_passes(
    leg: str, legs: dict[str, Future[LegResult]], request: pytest.FixtureRequest
) -> None:
    result = legs[leg].result()
    add_summary(request, "version matrix", result.headline())
    tail = result.output[-8000:]
    assert result.versions, tail
    installed = {n: result.versions[n] for n in OPTIONAL if result.versions[n] != "missing"}
    assert not installed, f"{leg} has optional stacks installed, it shows nothing: {installed}"
    assert result.without_optional == "ok", (
        f"{leg}: the library without {', '.join(OPTIONAL)}:\n{result.without_optional}"
    )
    passed, returncode = result.counts.get("passed", 0), result.returncode
    assert passed > 0, f"no test passed in {leg}\n{tail}"
    failed = "\n  ".join(["", *result.failed])
    assert returncode == 0, f"{leg} ({LEGS[leg]}): {len(result.failed)} failed:{failed}\n{tail}"
