"""A signal handler that sets an event its own thread was inside (``relay.stop()`` from SIGTERM,
``Consumer.stop()`` from Ctrl-C) must go through, not wait for itself.

Each case runs in a child process with a timeout, so a regression fails instead of hanging the
suite: the main thread holds the event's lock (where ``wait()``, ``clear()`` and ``set()`` hold
it) when SIGUSR1 arrives, and the handler sets the event.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    from reliable_amqp._sync._events import SignalSafeEvent

    event = {"plain": threading.Event, "safe": SignalSafeEvent}[sys.argv[1]]()
    signal.signal(signal.SIGUSR1, lambda _signum, _frame: event.set())
    with event._cond:  # inside clear(), or wait() right after it woke
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):  # the handler runs between two of these bytecodes
            pass
    print("set" if event.is_set() else "not set")
    """
)


def _run(kind: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, kind],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )


def test_a_handler_sets_the_event_its_thread_was_inside() -> None:
    done = _run("safe")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "set"


def test_a_plain_threading_event_waits_for_itself_there() -> None:
    """Why the library does not use threading.Event for what its signal handlers set."""
    with pytest.raises(subprocess.TimeoutExpired):
        _run("plain")


def test_what_the_signal_handlers_set_is_signal_safe(tmp_path: Path) -> None:
    from reliable_amqp import Consumer
    from reliable_amqp._sync._events import SignalSafeEvent
    from reliable_amqp.outbox._relay import OutboxRelay

    consumer = Consumer("amqp://guest:guest@127.0.0.1:1/%2F", "q")
    assert isinstance(consumer._stop, SignalSafeEvent)
    relay = OutboxRelay(f"sqlite:///{tmp_path}/app.db", "amqp://guest:guest@127.0.0.1:1/%2F")
    assert isinstance(relay._wake, SignalSafeEvent)
    from reliable_amqp.cli._supervisor import _Signals

    assert isinstance(_Signals().wake, SignalSafeEvent)  # the worker's supervisor
