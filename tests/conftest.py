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
from support.broker import AMQP_HOST, AMQP_PORT, AMQP_URL, BrokerAdmin
from support.jvm import use_for_local_drivers
from support.run_summary import summary_sections

use_for_local_drivers()  # C1 and the serial collector for every Spark driver (support.jvm)


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


#: Work units for pytest-xdist (``RELIABLE_AMQP_TEST_WORKERS=2 scripts/dev.sh test`` runs
#: ``-n 2 --dist loadgroup``): a test module is one unit (its module fixtures are set up once),
#: but these directories are one unit each, for what their tests share (spark: one SparkSession
#: and one Spark cluster; cluster: one three-node RabbitMQ 4 cluster; rabbitmq4: one RabbitMQ 4
#: node).
SHARED_SESSION = {"spark": "spark", "cluster": "cluster", "rabbitmq4": "rabbitmq4"}
#: The longest units, handed out first so that no worker is left with a long one at the end
#: (longest first; --durations of one run in a single process on a loaded machine, 2,496 s of
#: tests in all). Every other unit follows in collection order.
LONGEST_FIRST = (
    "spark",  # 677 s
    "cluster",  # 310 s before its consumer and stream-read modules (one cluster for all)
    "faults/test_spool_faults.py",  # 229 s
    "matrix/test_versions.py",  # 196 s
    "rabbitmq4",  # 114 s (its leg 93 s before it ran only the subset's broker tests)
    "async/test_async_faults.py",  # 81 s
    "outbox/test_relay.py",  # 77 s
    "spool/test_spool_publisher.py",  # 65 s
    "consumer/test_consumer_faults.py",  # 60 s (its own disposable node: 12 s of it)
    "test_benchmarks.py",  # 57 s
    "test_publish_inputs_broker.py",  # 42 s
    "cli/test_worker.py",  # 40 s
    "faults/test_sync_faults.py",  # 38 s
    "cli/test_cli_interrupt.py",  # 32 s
    "spool/test_spool_crash.py",  # 31 s
    "outbox/test_relay_faults.py",  # 29 s
)
TESTS = Path(__file__).parent


def work_unit(item: pytest.Item) -> str:
    """The pytest-xdist group of ``item``: its module, or its directory's shared session."""
    relative = item.path.relative_to(TESTS).as_posix()
    return SHARED_SESSION.get(relative.split("/", 1)[0], relative)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``rabbitmq_only`` says why: ``rabbitmq_only(reason="...")``. A test marked
    ``probe`` runs only with ``RELIABLE_AMQP_PROBES=1``. Under
    pytest-xdist workers (``-n`` above 0), each test is given its work unit, and the longest
    units come first; a run in one process keeps the collection order."""
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
    if not hasattr(config, "workerinput"):  # not an xdist worker (which alone collects there)
        return
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    units = {item: work_unit(item) for item in items}
    items.sort(key=lambda item: rank.get(units[item], len(rank)))  # stable: collection order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(units[item]))


def _early_hooks(session: pytest.Session) -> Any:
    """The version matrix's module, when its legs are among this run's tests."""
    for item in session.items:
        path = item.path
        if (path.parent.name, path.name) == ("matrix", "test_versions.py") and item.name.startswith(
            "test_contract_subset_passes"
        ):
            return getattr(item, "module", None)
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """In a one-process run, start the version matrix's legs now: they run beside the rest of
    the suite (tests/matrix/test_versions.py ``start_early``). Not under ``--collect-only``,
    nor in xdist workers (there the legs start when their tests do)."""
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
