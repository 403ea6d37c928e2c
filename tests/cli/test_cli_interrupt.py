"""Ctrl-C on `reliable-amqp publish` is obeyed wherever it lands (issue 33).

SIGINT is sent at a sweep of delays from the start of the process, so that it lands while
Python starts, while the input is read, while connecting, while messages are handed over (also
into a full in-flight window, where ``publish()`` blocks), and while confirms are awaited; a
core is kept busy meanwhile, as on a loaded CI machine. Every run must end within 5 s of the
signal, and account for every message: exit 130 with exactly the messages the queue did not get
in ``--failed`` (or, interrupted before anything was sent, nothing sent and ``--failed`` left
alone). Some runs get a second Ctrl-C soon after the first, which cuts the wait for confirms.

The queue never confirms past two messages (``x-max-length`` 2, ``reject-publish``) and the
nack policy is patient, so a run is still going whenever the signal comes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from reliable_amqp.cli._interrupt import REDELIVER, Interrupts
from support.broker import BrokerAdmin

pytestmark = [pytest.mark.broker, pytest.mark.slow]

#: how long a run may take to end after the (first) signal
OBEYED_WITHIN = 5.0


def _start(
    url: str, queue: str, source: Path, failed: Path, window: int | None
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "reliable_amqp", "publish", str(source), "--routing-key", queue]
    argv += ["--nack-retries", "1000", "--retry-initial-delay", "0.2", "--retry-max-delay", "0.2"]
    argv += ["--failed", str(failed)]
    if window is not None:
        argv += ["--max-in-flight", str(window)]
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "AMQP_URL": url},
    )


def _first_message_after(broker: BrokerAdmin, url: str, tmp_path: Path) -> float:
    """Seconds from the start of a run to its first message in the queue, on this machine now
    (the sweep spreads its signals over a little more than that)."""
    queue = broker.queue(x_max_length=2, x_overflow="reject-publish")
    source = tmp_path / "calibrate.txt"
    source.write_text("1\n")
    started = time.monotonic()
    process = _start(url, queue, source, tmp_path / "calibrate.jsonl", None)
    try:
        while broker.count(queue) < 1:
            assert time.monotonic() - started < 60, "the command never published"
            time.sleep(0.02)
        return time.monotonic() - started
    finally:
        process.kill()
        process.communicate()


@pytest.mark.usefixtures("sigint_obeyed")
@pytest.mark.parametrize(
    ("count", "window"),
    [(20, None), (200, 5)],  # the second keeps publish() blocked on a full window
    ids=["confirms", "full-window"],
)
def test_ctrl_c_at_any_moment_exits_130_with_every_message_accounted_for(
    amqp_url: str,
    broker: BrokerAdmin,
    tmp_path: Path,
    *,
    busy_core: None,
    record_property: Callable[[str, object], None],
    count: int,
    window: int | None,
) -> None:
    slowest = 0.0
    ready = _first_message_after(broker, amqp_url, tmp_path)
    steps = 6
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{n}\n" for n in range(1, count + 1)))
    outcomes = []
    for step in range(steps):
        queue = broker.queue(x_max_length=2, x_overflow="reject-publish")
        failed = tmp_path / f"failed-{step}.jsonl"
        process = _start(amqp_url, queue, source, failed, window)
        if step < steps // 2:  # from the start: Python starting, reading, connecting, ...
            delay = ready * step / (steps // 2 - 1)
            time.sleep(delay)
        else:  # once messages flow: handing them over, waiting for room, for confirms
            while broker.count(queue) < 1 and process.poll() is None:
                time.sleep(0.01)
            delay = 0.15 * (step - steps // 2)
            time.sleep(delay)
        process.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        if step % 2:  # a second Ctrl-C soon after: stop waiting for confirms
            time.sleep(0.1)
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        try:
            _out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _out, err = process.communicate()
            pytest.fail(f"Ctrl-C at step {step}: still running 30 s later\n{err}")
        took = time.monotonic() - signalled
        slowest = max(slowest, took)
        record_property("slowest_exit_s", round(slowest, 2))  # (in --junitxml's report)
        assert took < OBEYED_WITHIN, f"Ctrl-C at step {step}: {took:.1f} s to exit\n{err}"
        stored = broker.count(queue)
        unconfirmed = [str(n) for n in range(stored + 1, count + 1)]
        if failed.exists():
            records = [json.loads(line) for line in failed.read_text().splitlines()]
            assert process.returncode == 130, err
            assert [r["body"] for r in records] == unconfirmed, err
            assert "interrupted" in err
            outcomes.append("accounted")
        else:
            # Interrupted before anything was sent: while the input was read (the command
            # says so, exit 130), or while Python was still starting (killed by SIGINT,
            # which a shell reports as 130 too; or, in CPython's own start of `python -m`,
            # exit 1 with "Could not import runpy module").
            assert stored == 0, err
            assert process.returncode in (130, -signal.SIGINT) or (
                process.returncode == 1 and "Could not import runpy module" in err
            ), err
            outcomes.append("before")
    # the sweep did reach the runs that had sent messages
    assert outcomes[steps // 2 :] == ["accounted"] * (steps // 2), outcomes


def test_a_ctrl_c_python_drops_in_a_weakref_callback_is_delivered_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Python drops a KeyboardInterrupt raised in a weakref callback ("Exception ignored in"),
    as it did to a Ctrl-C that came during a lazy import (the import system's module-lock
    callback): the publish command then ran on for 30 s. Inside ``Interrupts`` the dropped
    interrupt comes again, as the same press, and nothing is printed."""

    class Thing:
        pass

    def callback(_ref: object) -> None:
        signal.raise_signal(signal.SIGINT)  # the handler runs in here, and raises in here
        for _ in range(10_000):  # (bytecode for the handler to run on)
            pass

    before = sys.unraisablehook
    with Interrupts() as interrupts:
        thing = Thing()
        ref = weakref.ref(thing, callback)
        with pytest.raises(KeyboardInterrupt):
            del thing  # the callback runs now; its KeyboardInterrupt is dropped by Python
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert ref() is None
        assert interrupts.presses == 1
    assert "Exception ignored" not in capsys.readouterr().err
    assert sys.unraisablehook is before  # given back


def test_other_unraisable_exceptions_still_reach_the_hook_there_was() -> None:
    seen: list[BaseException | None] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_value)
    try:
        with Interrupts():

            class Thing:
                pass

            def callback(_ref: object) -> None:
                raise ValueError("a callback's own error")

            thing = Thing()
            ref = weakref.ref(thing, callback)
            del thing
            assert ref() is None
    finally:
        sys.unraisablehook = previous
    assert [type(e) for e in seen] == [ValueError]


def test_a_press_noted_and_not_acted_on_is_raised_leaving_the_block() -> None:
    """A Ctrl-C deferred and never checked is raised by the block's end, and no redelivery of
    it reaches the handler there was before (it met Python's default handler after the command
    had returned, and the process died of SIGINT instead of exiting 130)."""
    after: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: after.append(signum))
    try:
        with pytest.raises(KeyboardInterrupt), Interrupts() as interrupts:
            interrupts.deferring = True
            signal.raise_signal(signal.SIGINT)  # noted, not raised: nothing checks it
            assert interrupts.pending
        deadline = time.monotonic() + 10 * REDELIVER  # when a redelivery would have come
        while time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert after == []
    assert interrupts.presses == 1


def test_a_redelivery_of_a_press_already_acted_on_is_dropped() -> None:
    """The redelivery was on its way when the main thread acted on the press: it is no press."""
    with Interrupts() as interrupts:
        interrupts.deferring = True
        signal.raise_signal(signal.SIGINT)
        interrupts._redelivering = True  # as _redeliver sets it before it sends
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        signal.raise_signal(signal.SIGINT)  # ... and here it comes
        for _ in range(10_000):  # (bytecode for the handler to run on)
            pass
        assert not interrupts.pending
        assert interrupts.presses == 1


#: a program whose command has decided its outcome (exit 3, a line on stdout not yet flushed)
#: and then gets Ctrl-C while it exits; argv[1] is how many presses
_LATE = """
import atexit, os, signal, sys, time
import reliable_amqp.cli as cli

def decided(argv=None):
    sys.stdout.write("outcome said")
    return 3

def presses():
    for _ in range(int(sys.argv[1])):
        signal.raise_signal(signal.SIGINT)
        for _ in range(10_000):  # (bytecode for the handler to run on)
            pass
    time.sleep(60 if sys.argv[1] == "2" else 0)  # a shutdown that hangs

cli.main = decided
atexit.register(presses)
cli.run()
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_a_ctrl_c_after_the_outcome_changes_neither_code_nor_output(presses: int) -> None:
    """Once main() returned, a press while the process exits is ignored (Python's default
    handler printed a KeyboardInterrupt traceback from the shutdown and died of SIGINT); a
    second one ends a shutdown that hangs, with the same code and the output flushed."""
    done = subprocess.run(
        [sys.executable, "-c", _LATE, str(presses)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "outcome said", "")
