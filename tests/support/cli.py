"""Running the ``reliable-amqp`` command line as a subprocess (tests/cli)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_cli(
    *args: str,
    url: str | None,
    stdin: bytes | None = None,
    timeout: float = 60,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m reliable_amqp ARGS`` with AMQP_URL set (unless ``url`` is None) and ``env``."""
    given = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_AMQP_")}
    for name in ("AMQP_URL", "AMQP_USERNAME", "AMQP_PASSWORD"):
        env.pop(name, None)
    if url is not None:
        env["AMQP_URL"] = url
    env.update(given)
    result = subprocess.run(
        [sys.executable, "-m", "reliable_amqp", *args],
        input=stdin.decode() if stdin is not None else "",
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    return result
