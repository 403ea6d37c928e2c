"""``reliable-amqp worker --processes N``: N consumer processes, restarted when they die; and
the ``--health-port`` HTTP endpoint.

Children are started, not forked: each is a new interpreter running ``reliable-amqp worker
--child`` (the handler's module imported afresh). A fork would copy whatever the handler's
module opened at import (a database pool's sockets, an exporter's thread), and once this
process runs its own threads (the health server, the report readers) a fork can copy a lock
another thread holds, which Python 3.12 warns about; a child started anew is what a
supervisor such as systemd would start. The price is its start-up time, once per restart.

Each child writes its consumer's health, one JSON line a second, to a pipe of its own; the
parent is healthy when every child is alive, reported within :data:`STALE` seconds and is
healthy. A child that dies is started again after a delay that doubles from
:data:`RESTART_DELAY` to :data:`RESTART_MAX_DELAY` (back to the start once a child was healthy
for :data:`RESTART_RESET` seconds); after :data:`GIVE_UP_DEATHS` deaths within
:data:`GIVE_UP_WINDOW` seconds, or a child that exits 2 (bad arguments, a queue it may not
use: restarting cannot help), the worker gives up: it logs an ERROR, stops the others and exits
non-zero. SIGTERM (and the first Ctrl-C) is passed on to the children as SIGTERM: each stops
gracefully within ``--stop-timeout``; a second Ctrl-C kills them (the broker gives back what
they held unacked).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

from reliable_amqp._sync._events import SignalSafeEvent
from reliable_amqp.cli._parse import (
    EXIT_INTERRUPTED,
    EXIT_NOT_CONFIRMED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
)

#: the environment variable a child reads its options from (JSON of the parent's arguments)
ARGS_ENV = "RELIABLE_AMQP_WORKER_ARGS"


class Target(Protocol):
    """What the supervisor needs of the worker's prepared handler: which one, on which queue."""

    @property
    def queue(self) -> str: ...

    @property
    def target(self) -> str: ...


def child_arguments(args: argparse.Namespace) -> str:
    """The JSON a child reads its options from: the parent's, without what the parent does
    (processes, health)."""
    given = {**vars(args), "processes": None, "health_port": None, "child": None}
    return json.dumps(given)


log = logging.getLogger("reliable_amqp.worker")

#: the first wait before a dead child is started again; it doubles up to RESTART_MAX_DELAY
RESTART_DELAY = 1.0
RESTART_MAX_DELAY = 30.0
#: a child healthy this long (seconds) has its restart delay back at RESTART_DELAY
RESTART_RESET = 30.0
#: so many deaths within GIVE_UP_WINDOW seconds and the worker gives up
GIVE_UP_DEATHS = 5
GIVE_UP_WINDOW = 60.0
#: a child whose last health report is older than this (seconds) counts as unhealthy
STALE = 3.0
#: added to --stop-timeout for a child to exit after SIGTERM (closing, and its start-up)
STOP_GRACE = 10.0


# --- health over HTTP ----------------------------------------------------------------------------


class HealthServer:
    """``GET /healthz`` and ``GET /readyz``: 200 with the health as JSON when ``probe`` says
    healthy, 503 with it when not; a daemon thread (:mod:`http.server`, no dependency)."""

    def __init__(
        self, host: str, port: int, probe: Callable[[], tuple[bool, dict[str, object]]]
    ) -> None:
        self.host = host
        self.port = port
        self._probe = probe
        self._server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> None:
        """Listen (a busy port is a UsageError) and serve on a daemon thread."""
        probe = self._probe

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/healthz", "/readyz"):
                    self._answer(404, {"error": "not found: GET /healthz or /readyz"})
                    return
                try:
                    healthy, health = probe()
                except Exception as exc:  # a probe that cannot tell is a failing probe
                    healthy, health = False, {"healthy": False, "error": repr(exc)}
                self._answer(200 if healthy else 503, health)

            def _answer(self, status: int, body: dict[str, object]) -> None:
                data = json.dumps(body).encode() + b"\n"
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not worth a log line

        try:
            server = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as exc:
            raise UsageError(
                f"cannot serve health on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from None
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        threading.Thread(
            target=server.serve_forever, name="reliable-amqp-worker-health", daemon=True
        ).start()
        log.info("worker: health on http://%s:%d/healthz and /readyz", self.host, self.port)

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


# --- the children --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Child:
    """One child process and what it last reported."""

    proc: subprocess.Popen[bytes]
    started: float
    report: dict[str, Any] | None = None
    reported_at: float | None = None
    healthy_since: float | None = None

    def healthy(self, now: float) -> bool:
        return (
            self.proc.returncode is None
            and self.report is not None
            and self.reported_at is not None
            and now - self.reported_at <= STALE
            and bool(self.report.get("healthy"))
        )


@dataclass(eq=False)
class _Slot:
    """One of the N places a child runs in, across restarts."""

    index: int
    child: _Child | None = None
    delay: float = RESTART_DELAY
    restart_at: float = 0.0
    restarts: int = 0
    last_status: int | None = None


@dataclass(eq=False)
class _Signals:
    """What the signal handlers asked for (main thread)."""

    stop: int | None = None
    presses: int = 0
    #: set by the handlers; reentrant, as the main thread is inside its wait() or clear() then
    wake: threading.Event = field(default_factory=SignalSafeEvent)


def describe(status: int) -> str:
    """``exited with status 1`` or ``was killed by SIGKILL``."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


class Supervisor:
    """Runs ``--processes`` children of ``reliable-amqp worker`` and keeps them running."""

    def __init__(self, args: argparse.Namespace, spec: Target) -> None:
        self.args = args
        self.spec = spec
        self.slots = [_Slot(i) for i in range(args.processes)]
        self.stop_timeout: float = args.stop_timeout
        self._lock = threading.Lock()  # slots' children and reports: main and reader threads
        self._deaths: deque[float] = deque()
        self._signals = _Signals()
        self._stopping = False

    # --- the main loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Until SIGTERM, Ctrl-C or giving up; the exit code."""
        server = None
        if self.args.health_port is not None:
            server = HealthServer(self.args.health_host, self.args.health_port, self.health)
            server.start()
        restore = self._install_signals()
        log.info(
            "worker: %d processes consuming %r with %s",
            len(self.slots),
            self.spec.queue,
            self.spec.target,
        )
        code = EXIT_OK
        try:
            for slot in self.slots:
                self._start(slot)
            code = self._watch()
        finally:
            self._stopping = True
            code = self._stop_children(code)
            restore()
            if server is not None:
                server.close()
        return code

    def _watch(self) -> int:
        signals = self._signals
        while signals.stop is None:
            now = time.monotonic()
            for slot in self.slots:
                child = slot.child
                if child is not None and child.proc.poll() is not None:
                    given_up = self._died(slot, child, now)
                    if given_up is not None:
                        return given_up
                elif child is None and now >= slot.restart_at:
                    self._start(slot)
            signals.wake.wait(0.1)
            signals.wake.clear()
        log.info("worker: stopping %d processes", sum(s.child is not None for s in self.slots))
        return EXIT_INTERRUPTED if signals.stop == signal.SIGINT and signals.presses > 1 else 0

    def _died(self, slot: _Slot, child: _Child, now: float) -> int | None:
        """A child died on its own: schedule its restart, or give up (the exit code then)."""
        status = child.proc.returncode
        with self._lock:
            slot.child = None
        slot.last_status = status
        pid = child.proc.pid
        if status == EXIT_USAGE:
            log.error(
                "worker: process %d (pid %d) exited with status 2 (bad arguments, or a queue "
                "it cannot consume): not restarting it; stopping the others",
                slot.index,
                pid,
            )
            return EXIT_USAGE
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > GIVE_UP_WINDOW:
            self._deaths.popleft()
        if len(self._deaths) >= GIVE_UP_DEATHS:
            log.error(
                "worker: giving up: worker processes died %d times within %.0f s, the last "
                "(process %d, pid %d) %s; stopping the others",
                len(self._deaths),
                GIVE_UP_WINDOW,
                slot.index,
                pid,
                describe(status),
            )
            return EXIT_NOT_CONFIRMED
        if child.healthy_since is not None and now - child.healthy_since >= RESTART_RESET:
            slot.delay = RESTART_DELAY
        slot.restart_at = now + slot.delay
        log.warning(
            "worker: process %d (pid %d) %s; starting it again in %.0f s",
            slot.index,
            pid,
            describe(status),
            slot.delay,
        )
        slot.delay = min(slot.delay * 2, RESTART_MAX_DELAY)
        slot.restarts += 1
        return None

    def _start(self, slot: _Slot) -> None:
        read_fd, write_fd = os.pipe()
        env = {**os.environ, ARGS_ENV: child_arguments(self.args)}
        command = [
            sys.executable, "-m", "reliable_amqp", "worker", self.spec.target,
            "--queue", self.spec.queue, "--child", f"{slot.index}:{write_fd}",
        ]  # fmt: skip
        try:
            proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, pass_fds=(write_fd,)
            )
        finally:
            os.close(write_fd)  # the child's now: EOF on read_fd once it exits
        child = _Child(proc, time.monotonic())
        with self._lock:
            slot.child = child
        threading.Thread(
            target=self._read_reports,
            args=(child, read_fd),
            name=f"reliable-amqp-worker-reports-{proc.pid}",
            daemon=True,
        ).start()
        log.info(
            "worker: process %d started (pid %d)%s",
            slot.index,
            proc.pid,
            f", restart {slot.restarts}" if slot.restarts else "",
        )

    def _read_reports(self, child: _Child, fd: int) -> None:
        with open(fd, "rb") as reports:
            for line in reports:
                try:
                    report = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(report, dict):
                    continue
                now = time.monotonic()
                with self._lock:
                    child.report, child.reported_at = report, now
                    if not report.get("healthy"):
                        child.healthy_since = None
                    elif child.healthy_since is None:
                        child.healthy_since = now

    # --- stopping ----------------------------------------------------------------------------

    def _stop_children(self, code: int) -> int:
        """SIGTERM each child, wait for it (``--stop-timeout`` plus a grace), kill what is left;
        the exit code: ``code``, or 1 when a child did not stop cleanly."""
        children = [(s, s.child) for s in self.slots if s.child is not None]
        for _, child in children:
            _signal(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout + STOP_GRACE
        unclean = 0
        for slot, child in children:
            while True:
                if self._signals.presses > 1:  # a second Ctrl-C: at once
                    _signal(child.proc, signal.SIGKILL)
                    code = EXIT_INTERRUPTED
                try:
                    status = child.proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        log.error(
                            "worker: process %d (pid %d) did not stop within %.0f s: killed",
                            slot.index,
                            child.proc.pid,
                            self.stop_timeout + STOP_GRACE,
                        )
                        _signal(child.proc, signal.SIGKILL)
            if status != 0 and code not in (EXIT_INTERRUPTED,):
                unclean += 1
                log.error(
                    "worker: process %d (pid %d) %s while stopping",
                    slot.index,
                    child.proc.pid,
                    describe(status),
                )
        if unclean and code == EXIT_OK:
            code = EXIT_NOT_CONFIRMED
        if code == EXIT_OK:
            log.info("worker: every process stopped gracefully")
        return code

    def _install_signals(self) -> Callable[[], None]:
        signals = self._signals

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if signum == signal.SIGINT:
                signals.presses += 1
            if signals.stop is None:
                signals.stop = signum
            signals.wake.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

        return restore

    # --- health --------------------------------------------------------------------------------

    def health(self) -> tuple[bool, dict[str, object]]:
        """Healthy when every child is (any thread: the health server's)."""
        now = time.monotonic()
        processes: list[dict[str, object]] = []
        with self._lock:
            for slot in self.slots:
                child = slot.child
                alive = child is not None and child.proc.returncode is None
                processes.append(
                    {
                        "index": slot.index,
                        "pid": child.proc.pid if child is not None else None,
                        "alive": alive,
                        "restarts": slot.restarts,
                        "healthy": child is not None and child.healthy(now),
                        "report_age": None
                        if child is None or child.reported_at is None
                        else round(now - child.reported_at, 3),
                        "health": child.report if child is not None else None,
                    }
                )
        healthy = not self._stopping and all(p["healthy"] for p in processes)
        return healthy, {"healthy": healthy, "processes": processes}


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if proc.poll() is None:
            proc.send_signal(signum)
