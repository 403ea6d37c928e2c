"""`reliable-amqp publish` on a real terminal (tmux): retries show as they happen, and the final
error is one line, printed once (issue 20, "failures that read well")."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from support.broker import BrokerAdmin


def refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Terminal:
    """A tmux session of its own (its own server socket) running one command."""

    def __init__(self, tmp_path: Path) -> None:
        self.socket = f"reliable-amqp-test-{os.getpid()}-{time.monotonic_ns()}"
        self.config = tmp_path / "tmux.conf"
        # the pane stays after the command ends, so its last screen can be read
        self.config.write_text("set -g remain-on-exit on\n")

    def tmux(self, *args: str) -> str:
        result = subprocess.run(
            ["tmux", "-L", self.socket, "-f", str(self.config), *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        return result.stdout

    def run(self, command: str) -> None:
        self.tmux("new-session", "-d", "-x", "160", "-y", "20", command)

    def screen(self) -> str:
        """What the terminal shows, with what scrolled off the top of it."""
        return self.tmux("capture-pane", "-p", "-S", "-")

    def wait_for(self, text: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if text in screen or time.monotonic() > deadline:
                return screen
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, check=False)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Terminal]:
    term = Terminal(tmp_path)
    yield term
    term.close()


def test_a_refused_port_shows_each_retry_then_the_error_once(
    terminal: Terminal, tmp_path: Path
) -> None:
    port = refused_port()
    source = tmp_path / "in.txt"
    source.write_text("a\nb\n")
    argv = [
        sys.executable,
        "-m",
        "reliable_amqp",
        "publish",
        str(source),
        "--routing-key",
        "q",
        "--url",
        f"amqp://guest:s3cret-pw@127.0.0.1:{port}/",
        "--connect-retries",
        "2",
        "-o",
        "connect_policy.initial_delay=0.8",
        "-o",
        "connect_policy.max_delay=0.8",
        "-o",
        "connect_policy.jitter=0",
    ]
    terminal.run(f"{shlex.join(argv)}; echo EXIT=$?")
    cause = f"connection refused at 127.0.0.1:{port}"
    # while it waits: the cause, which attempt comes next and when
    first = terminal.wait_for("attempt 2 of 3")
    assert f"reliable-amqp: {cause}; retrying: attempt 2 of 3, next in 0.8 s" in first, first
    second = terminal.wait_for("attempt 3 of 3")
    assert f"reliable-amqp: {cause}; retrying: attempt 3 of 3, next in 0.8 s" in second, second
    assert "attempt 2 of 3" not in second  # the status line was replaced, not added to
    final = terminal.wait_for("EXIT=")
    assert "EXIT=3" in final, final
    lines = [line.rstrip() for line in final.splitlines() if line.strip()]
    # one line with the cause, printed once; the retry status is gone; no class names
    assert [line for line in lines if cause in line] == [
        f"reliable-amqp: cannot connect to amqp://guest:***@127.0.0.1:{port}/: gave up "
        f"connecting after 3 attempts: {cause}"
    ]
    assert not [line for line in lines if "attempt 3 of 3" in line or "Error" in line]
    assert "2 messages (lines 1 to 2) not sent: no connection to the broker" in lines
    assert "s3cret-pw" not in final
    # nothing was published: no progress bar ("0/2 confirmed ... 2 failed", issue 33); the
    # note shown while the input was checked is gone
    assert not [line for line in lines if line.startswith("[")] and "0/2" not in final, final
    assert "reading and checking" not in final


@pytest.mark.faults
def test_a_connection_lost_mid_run_shows_on_the_progress_bar_then_the_error_once(
    terminal: Terminal, tmp_path: Path, broker: BrokerAdmin, make_proxy: Any
) -> None:
    # a queue that takes 2 and nacks the rest: the run keeps retrying them until the cut
    queue = broker.queue(
        **cast(dict[str, Any], {"x-max-length": 2, "x-overflow": "reject-publish"})
    )
    proxy = make_proxy()
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{i}\n" for i in range(1, 21)))
    argv = [
        sys.executable,
        "-m",
        "reliable_amqp",
        "publish",
        str(source),
        "--routing-key",
        queue,
        "--nack-retries",
        "1000",
        "--retry-initial-delay",
        "0.2",
        "--retry-max-delay",
        "0.2",
        "--url",
        proxy.url(),
        "--connect-retries",
        "2",
        "-o",
        "connect_policy.initial_delay=0.8",
        "-o",
        "connect_policy.max_delay=0.8",
        "-o",
        "connect_policy.jitter=0",
    ]
    terminal.run(f"{shlex.join(argv)}; echo EXIT=$?")
    deadline = time.monotonic() + 30
    while broker.count(queue) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    terminal.wait_for("2/20 confirmed")
    proxy.refuse()
    proxy.cut()
    during = terminal.wait_for("reconnecting: attempt 2 of 3, next in 0.8 s")
    bar = [line for line in during.splitlines() if line.startswith("[")]
    assert len(bar) == 1 and "(reconnecting: attempt 2 of 3, next in 0.8 s; " in bar[0], during
    final = terminal.wait_for("EXIT=")
    assert "EXIT=3" in final, final
    text = final.replace("\n", "")  # the error line may wrap on the terminal
    assert text.count("gave up connecting after 3 attempts") == 1, final
    assert "reliable-amqp: the connection to " in final
    assert len([line for line in final.splitlines() if line.startswith("[")]) == 1, final
    assert "18 messages (lines 3 to 20) not confirmed: no connection to the broker" in final
