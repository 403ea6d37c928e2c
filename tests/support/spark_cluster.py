"""A Spark standalone cluster from the installed PySpark: one master and two workers on loopback.

Started with PySpark's own ``bin/spark-class`` (``org.apache.spark.deploy.master.Master`` and
``org.apache.spark.deploy.worker.Worker``), as ``sbin/start-master.sh`` would, but in the
foreground of their own processes so that each is stopped (or killed) by its own pid. Every
daemon has its own ports and work directory under one run directory; each worker offers 1 core
and 1 GiB. Python on the executors is this interpreter (``PYSPARK_PYTHON=sys.executable``),
where ``reliable_amqp`` is installed.

    python tests/support/spark_cluster.py    # start one, print its master URL, stop on Ctrl-C

Used by tests/spark/test_cluster.py (a module-scoped fixture) and scripts/spark_cluster.sh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pyspark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: support.*
from support.jvm import SPARK_JVM_OPTIONS

SPARK_HOME = Path(pyspark.__file__).parent
WORKERS = 2
WORKER_CORES = 1
WORKER_MEMORY = "1g"
#: heap of the master and worker daemons themselves (what they offer executors is WORKER_MEMORY)
DAEMON_MEMORY = "256m"
EXECUTOR_BACKEND = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:  # gone
        return []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, depth first."""
    out: list[int] = []
    for child in children(pid):
        out.append(child)
        out.extend(descendants(child))
    return out


def cmdline(pid: int) -> str:
    """A process's command line, space-separated ("" once it is gone)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class Daemon:
    """One master or worker JVM (``spark-class`` execs java: the pid is the JVM's)."""

    name: str
    args: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The JVM's pid."""
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    def running(self) -> bool:
        """Whether the JVM runs."""
        return self.process is not None and self.process.poll() is None


@dataclass
class SparkCluster:
    """A master and :data:`WORKERS` workers; ``start()``, then ``stop()`` (or a ``with``)."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ra-spark-cluster-")))
    master_port: int = field(default_factory=free_port)
    master_ui_port: int = field(default_factory=free_port)
    master: Daemon | None = None
    workers: list[Daemon] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The master URL to give ``SparkSession.builder.master``."""
        return f"spark://127.0.0.1:{self.master_port}"

    def env(self) -> dict[str, str]:
        """The environment of the daemons (and so of the executors they launch)."""
        conf = self.root / "conf"  # empty: no spark-defaults.conf or spark-env.sh of the machine
        conf.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_"))}
        env.update(
            SPARK_HOME=str(SPARK_HOME),
            SPARK_CONF_DIR=str(conf),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
            SPARK_DAEMON_JAVA_OPTS=SPARK_JVM_OPTIONS,
            SPARK_NO_DAEMONIZE="1",
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
        )
        return env

    def _launch(self, daemon: Daemon) -> None:
        with daemon.log.open("ab") as log:
            daemon.process = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *daemon.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                cwd=self.root,
                start_new_session=True,  # Ctrl-C of the test run reaches them through stop()
            )

    def start(self, timeout: float = 120) -> SparkCluster:
        """Start the master and the workers; return once the master counts every worker."""
        self.master = Daemon(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host", "127.0.0.1",
                "--port", str(self.master_port),
                "--webui-port", str(self.master_ui_port),
            ],
            self.root / "master.log",
        )  # fmt: skip
        self._launch(self.master)
        for n in range(WORKERS):
            work = self.root / f"worker-{n}"
            work.mkdir(exist_ok=True)
            worker = Daemon(
                f"worker-{n}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    "--host", "127.0.0.1",
                    "--port", str(free_port()),
                    "--webui-port", str(free_port()),
                    "--cores", str(WORKER_CORES),
                    "--memory", WORKER_MEMORY,
                    "--work-dir", str(work),
                    self.url,
                ],
                self.root / f"worker-{n}.log",
            )  # fmt: skip
            self.workers.append(worker)
            self._launch(worker)
        self.wait_for_workers(WORKERS, timeout)
        return self

    def state(self) -> dict[str, Any]:
        """The master's JSON status (its web UI's ``/json/``)."""
        url = f"http://127.0.0.1:{self.master_ui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as response:
            state: dict[str, Any] = json.load(response)
        return state

    def wait_for_workers(self, count: int, timeout: float = 120) -> None:
        """Wait until the master counts ``count`` alive workers."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            for daemon in [self.master, *self.workers]:
                if daemon is not None and daemon.process is not None and not daemon.running():
                    raise RuntimeError(f"{daemon.name} exited: {self._tail(daemon)}")
            try:
                last = self.state().get("aliveworkers")
                if last == count:
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.5)
        raise RuntimeError(f"the master counts {last!r} workers, not {count}, after {timeout} s")

    def restart_dead_workers(self, timeout: float = 120) -> None:
        """Start again any worker that is gone (a test killed it)."""
        for worker in self.workers:
            if not worker.running():
                self._launch(worker)
        self.wait_for_workers(WORKERS, timeout)

    def executors(self, worker: Daemon | None = None) -> list[int]:
        """The pids of executor JVMs the workers (or ``worker``) launched."""
        workers = [worker] if worker is not None else self.workers
        return [
            pid
            for w in workers
            if w.running()
            for pid in children(w.pid)
            if EXECUTOR_BACKEND in cmdline(pid)
        ]

    def kill_worker(self, worker: Daemon) -> list[int]:
        """kill -9 a worker and everything below it (its executor and Python workers): what
        losing a machine does. Returns the pids killed."""
        pids = [worker.pid, *descendants(worker.pid)]
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        if worker.process is not None:
            worker.process.wait(10)
        return pids

    def stop(self, timeout: float = 20) -> None:
        """Stop every daemon (and what it launched) by pid: SIGTERM, then SIGKILL."""
        daemons = [d for d in [*self.workers, self.master] if d is not None and d.running()]
        below = [pid for d in daemons for pid in descendants(d.pid)]
        for d in daemons:
            _signal(d.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for d in daemons:
            assert d.process is not None
            try:
                d.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(d.pid, signal.SIGKILL)
                d.process.wait(10)
        for pid in below:
            if alive(pid):
                _signal(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def _tail(self, daemon: Daemon, lines: int = 20) -> str:
        try:
            return "\n".join(daemon.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> SparkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def main() -> int:
    """Start a cluster, print its master URL and pids, stop it on Ctrl-C or SIGTERM."""
    cluster = SparkCluster()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster.start()
        assert cluster.master is not None
        print(f"master {cluster.url} (pid {cluster.master.pid}, UI :{cluster.master_ui_port})")
        for w in cluster.workers:
            print(f"{w.name} pid {w.pid} ({WORKER_CORES} core, {WORKER_MEMORY})")
        print(f"run directory {cluster.root}; Ctrl-C stops it", flush=True)
        while all(d.running() for d in [cluster.master, *cluster.workers]):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
