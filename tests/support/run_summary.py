"""Lines a test adds to the run's summary (the version matrix's legs, the RabbitMQ 4 headlines).

A line travels on the test's report (``user_properties``), so the process that prints the
summary sees it whether the test ran there or in a pytest-xdist worker (``scripts/dev.sh test``
runs the suite on workers). ``tests/conftest.py`` prints each section at the end of the run.
"""

from __future__ import annotations

import pytest

__all__ = ["add_summary", "summary_sections"]

_PREFIX = "summary:"


def add_summary(request: pytest.FixtureRequest, section: str, line: str) -> None:
    """Print ``line`` now (test output) and under ``section`` in the run's summary."""
    request.node.user_properties.append((_PREFIX + section, line))
    print(line)


def summary_sections(reports: list[pytest.TestReport]) -> dict[str, list[str]]:
    """{section: lines} from the call reports of a run, in the order of ``reports`` (under
    pytest-xdist, the order the workers finished the tests in)."""
    sections: dict[str, list[str]] = {}
    for report in reports:
        if report.when != "call":  # the teardown report carries the same properties
            continue
        for name, value in report.user_properties:
            if isinstance(name, str) and name.startswith(_PREFIX):
                sections.setdefault(name[len(_PREFIX) :], []).append(str(value))
    return sections
