"""Without OpenTelemetry in use, the library imports none of it (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CHECK = """
import sys
{body}
loaded = sorted(m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry."))
assert not loaded, loaded
print("clean")
"""


def _run(body: str) -> None:
    code = _CHECK.format(body=textwrap.dedent(body))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr


def test_import_reliable_amqp_imports_no_opentelemetry() -> None:
    _run(
        """
        import reliable_amqp
        from reliable_amqp import AsyncPublisher, Publisher, PublisherOptions
        """
    )


def test_deciding_telemetry_imports_no_opentelemetry_when_the_process_uses_none() -> None:
    _run(
        """
        from reliable_amqp import PublisherOptions
        from reliable_amqp._otel import telemetry_for
        options = PublisherOptions.create("amqp://guest:guest@127.0.0.1/%2F")
        assert telemetry_for(options, lambda: None) is None
        """
    )
