"""Shared fixtures: the real broker (an admin client for assertions) and the fault harness.

Broker tests never skip: when no broker answers, the session fails (scripts/dev.sh starts the
local RabbitMQ before pytest runs, so CI always has one). The broker is any AMQP 0-9-1 broker
named by ``AMQP_TEST_URL`` or ``AMQP_TEST_HOST``/``AMQP_TEST_PORT`` (``support.broker``); a test
that needs RabbitMQ itself is marked ``rabbitmq_only(reason=...)``, and
``-m "broker and not faults and not rabbitmq_only"`` is the portable contract.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import harness` from any test module

from harness.fixtures import *  # noqa: F403  (fault-injection fixtures)
from support import timeline
from support.broker import AMQP_HOST, AMQP_PORT, AMQP_URL, BrokerAdmin
from support.jvm import use_for_local_drivers
from support.run_summary import summary_sections

use_for_local_drivers()  # C1 and the serial collector for every Spark driver (support.jvm)


def pytest_configure(config: pytest.Config) -> None:
    """RELIABLE_AMQP_TIMELINE=DIR: where the suite's time goes (support.timeline)."""
    config.pluginmanager.register(timeline, "reliable-amqp-timeline")


def _broker_answers() -> bool:
    try:
        socket.create_connection((AMQP_HOST, AMQP_PORT), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With RELIABLE_AMQP_NO_SKIP=1 (``scripts/dev.sh test``, hence CI) a skipped test fails."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (
        report.skipped
        and not hasattr(report, "wasxfail")  # an expected failure is reported as skipped
        and os.environ.get("RELIABLE_AMQP_NO_SKIP") == "1"
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped, and nothing may skip here: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """The same for a module skipped as a whole (``importorskip`` at import)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and os.environ.get("RELIABLE_AMQP_NO_SKIP") == "1":
        report.outcome = "failed"


#: Work units for pytest-xdist (``scripts/dev.sh test`` runs ``-n 2 --dist loadgroup``): a test
#: module is one unit (its module fixtures are set up once), except :data:`LANE`, one unit in all.
#: The suite spends about 40% of a lone run's time with a core idle (vmstat, 2026-11-29: waits on
#: heartbeats, node restarts, JVM timers); two workers fill it. One of them runs the lane: Spark
#: (one SparkSession, one Spark cluster), the three-node RabbitMQ 4 cluster, the RabbitMQ 4 node
#: and the version matrix, one after another (never a JVM and a cluster start at once, and the
#: matrix's legs start beside the cluster: ``pytest_runtest_setup``), while the other worker runs
#: everything else in collection order; the first to finish takes what is left.
LANE = "lane:spark+cluster+rabbitmq4+matrix"
SHARED_SESSION = {"spark": LANE, "cluster": LANE, "rabbitmq4": LANE, "matrix": LANE}
#: Units handed out first, longest first (the lane: 750 s of a 1,750 s run of tests on a quiet
#: machine); every other unit follows in collection order.
LONGEST_FIRST = (LANE, "faults/test_spool_faults.py")
TESTS = Path(__file__).parent


def work_unit(item: pytest.Item) -> str:
    """The pytest-xdist unit of ``item``: its module, or :data:`LANE`."""
    return unit_of(item.path.relative_to(TESTS).as_posix())


def unit_of(relative: str) -> str:
    """The unit of a test file's path under tests/ (``spark/test_sink.py``)."""
    return SHARED_SESSION.get(relative.split("/", 1)[0], relative)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the units of :func:`unit_of`, handed out in the workers' collection
    order (:data:`LONGEST_FIRST` first). Not xdist's own loadgroup, which groups by an
    ``@group`` suffix it writes into ``item._nodeid``: pytest 9.2 no longer reads that attribute,
    so with pytest 9.2 and xdist 3.8 every test was a unit of its own (pytest-dev/pytest-xdist
    issue 1386, open), and two workers ran Spark, the clusters and the matrix at once."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Units(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return unit_of(path.removeprefix("tests/"))

    return Units(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``rabbitmq_only`` says why: ``rabbitmq_only(reason="...")``. A test marked
    ``probe`` runs only with ``RELIABLE_AMQP_PROBES=1``. In a pytest-xdist worker, the units of
    :data:`LONGEST_FIRST` come first (the order the controller hands units out in); a run in one
    process keeps the collection order."""
    for item in items:
        for mark in item.iter_markers("rabbitmq_only"):
            if not str(mark.kwargs.get("reason", "")).strip():
                raise pytest.UsageError(f'{item.nodeid}: rabbitmq_only needs reason="..."')
    if os.environ.get("RELIABLE_AMQP_PROBES") != "1":
        # a probe records a broker's behaviour, not the library's: run by hand (deselected,
        # and counted as such in the summary line, not skipped)
        probes = [item for item in items if item.get_closest_marker("probe") is not None]
        if probes:
            config.hook.pytest_deselected(items=probes)
            items[:] = [item for item in items if item.get_closest_marker("probe") is None]
    if hasattr(config, "workerinput"):  # an xdist worker (which alone collects there)
        rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(work_unit(item), len(rank)))  # stable


def _early_hooks(session: pytest.Session) -> Any:
    """The version matrix's module, when its legs are among this run's tests."""
    for item in session.items:
        path = item.path
        if (path.parent.name, path.name) == ("matrix", "test_versions.py") and item.name.startswith(
            "test_contract_subset_passes"
        ):
            return getattr(item, "module", None)
    return None


#: set in a worker once the matrix's legs were started there
_LEGS_STARTED = pytest.StashKey[bool]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist, the version matrix's legs start with the first test of :data:`LANE`
    in the worker that runs the lane (the worker whose tests read their results), beside the
    cluster's tests, which mostly wait."""
    config = item.config
    if not hasattr(config, "workerinput") or config.stash.get(_LEGS_STARTED, False):
        return
    if work_unit(item) != LANE:
        return
    config.stash[_LEGS_STARTED] = True
    module = _early_hooks(item.session)
    if module is not None:
        module.start_early(item.session.items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """In a one-process run, start the version matrix's legs now: they run beside the rest of
    the suite (tests/matrix/test_versions.py ``start_early``). Not under ``--collect-only``,
    nor in xdist workers (there they start with the lane: ``pytest_runtest_setup``)."""
    config = session.config
    if config.option.collectonly or hasattr(config, "workerinput"):
        return
    if int(getattr(config.option, "numprocesses", 0) or 0) > 0:
        return  # (the xdist controller: it runs no test)
    module = _early_hooks(session)
    if module is not None:
        module.start_early(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Wait for (or cancel) the matrix legs started early, whatever the run's outcome."""
    module = _early_hooks(session)
    if module is not None:
        module.finish_early()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The sections tests added (``support.run_summary.add_summary``): the version matrix's
    legs, the RabbitMQ 4 headlines; from this process's tests or from xdist workers' reports
    alike."""
    reports = [
        report
        for category in terminalreporter.stats.values()
        for report in category
        if isinstance(report, pytest.TestReport)
    ]
    for section, lines in summary_sections(reports).items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def busy_core() -> Iterator[None]:
    """One core kept busy for the test's duration."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.fixture
def sigint_obeyed() -> Iterator[None]:
    """Children that Python's KeyboardInterrupt handler is installed in, also when this run's
    SIGINT is ignored (a runner started in the background, or by nohup, ignores it, and a
    child inherits that: Python then installs no handler, and Ctrl-C does nothing)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler: children get SIG_DFL
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """URL of the shared test broker; fails (never skips) when it does not answer."""
    if not _broker_answers():
        pytest.fail(
            f"no AMQP broker answers at {AMQP_HOST}:{AMQP_PORT}: run the tests through "
            "`scripts/dev.sh test`, which starts the local RabbitMQ"
        )
    return AMQP_URL


@pytest.fixture
def broker(amqp_url: str) -> Iterator[BrokerAdmin]:
    """Admin access to the shared broker; queues and exchanges it declared are deleted after."""
    admin = BrokerAdmin(amqp_url)
    yield admin
    admin.close()
