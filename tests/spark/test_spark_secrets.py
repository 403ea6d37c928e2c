"""A password given to the Spark sink as an option shows nowhere: not in the streaming query's
``explain()``, not in Spark's event log, not in the driver's output, not in the sink's repr."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from support.broker import AMQP_HOSTPORT
from support.spark import read_all, unique_name

pytestmark = [
    pytest.mark.spark,
    pytest.mark.broker,
    pytest.mark.slow,
    pytest.mark.rabbitmq_only(reason="adds a broker user with rabbitmqctl"),
]


def _ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


def test_a_password_option_shows_nowhere(broker: Any, tmp_path: Path) -> None:
    user = unique_name("user")
    password = f"Pw-{uuid.uuid4().hex}-s3cret"
    _ctl("add_user", user, password)
    try:
        _ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        queue = broker.queue(unique_name("secret"))
        event_log, work = tmp_path / "events", tmp_path / "work"
        event_log.mkdir()
        work.mkdir()
        url = f"amqp://{AMQP_HOSTPORT}/%2F"  # no credentials in the URL: they are options
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_")}
        env["PYSPARK_PYTHON"] = env["PYSPARK_DRIVER_PYTHON"] = sys.executable
        probe = Path(__file__).with_name("secret_probe.py")
        done = subprocess.run(
            [sys.executable, str(probe), url, user, password, queue, str(event_log), str(work)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        received = read_all(broker.url, queue, expected=250)
        assert len(received) == 250  # 100 batch + 50 streamed + 100 through foreachPartition
        assert "== Physical Plan ==" in done.stdout  # the explain() output is there
        assert "sink repr:" in done.stdout
        logs = list(event_log.rglob("*"))
        assert any(p.is_file() for p in logs), "Spark wrote no event log"
        shown = {"stdout": done.stdout, "stderr": done.stderr}
        shown.update({str(p): p.read_text(errors="replace") for p in logs if p.is_file()})
        leaks = [where for where, text in shown.items() if password in text]
        assert leaks == [], f"the password shows in {leaks}"
    finally:
        _ctl("delete_user", user)
