"""`bash scripts/dev.sh main` (examples/quickstart.py) leaves its queue as it found it (issue 33):
run twice in a row, it reads back what it published, and whatever else the queue held stays,
in its order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pika
import pytest

from support.broker import BrokerAdmin, unique

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"

pytestmark = pytest.mark.broker


def test_the_quickstart_twice_leaves_its_queue_as_it_found_it(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    queue = broker.queue(unique("quickstart"))
    for i in range(3):
        broker.channel.basic_publish(
            "", queue, b"before %d" % i, pika.BasicProperties(message_id=f"before-{i}")
        )
    env = {**os.environ, "AMQP_URL": amqp_url, "QUICKSTART_QUEUE": queue}
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, str(QUICKSTART)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert "1000 confirmed by the broker, 0 failed" in result.stdout
        assert "read back 1000 of them from the queue" in result.stdout
    assert [body for _, body in broker.drain(queue)] == [b"before 0", b"before 1", b"before 2"]
