"""Shared fixtures: the real broker (an admin client for assertions) and the fault harness.

Broker tests never skip: when no broker answers, the session fails (scripts/dev.sh starts the
local RabbitMQ before pytest runs, so CI always has one). The broker is any AMQP 0-9-1 broker
named by ``AMQP_TEST_URL`` or ``AMQP_TEST_HOST``/``AMQP_TEST_PORT`` (``broker_support``); a test
that needs RabbitMQ itself is marked ``rabbitmq_only(reason=...)``, and
``-m "broker and not faults and not rabbitmq_only"`` is the portable contract.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import harness` from any test module

from broker_support import AMQP_HOST, AMQP_PORT, AMQP_URL, BrokerAdmin
from harness.fixtures import *  # noqa: F403  (fault-injection fixtures)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``rabbitmq_only`` says why: ``rabbitmq_only(reason="...")``."""
    for item in items:
        for mark in item.iter_markers("rabbitmq_only"):
            if not str(mark.kwargs.get("reason", "")).strip():
                raise pytest.UsageError(f'{item.nodeid}: rabbitmq_only needs reason="..."')


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
