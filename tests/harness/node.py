"""A disposable RabbitMQ node that fault-injection tests may kill -9 and restart.

The node runs beside the shared broker with its own name, ports, data, logs and Erlang cookie, so
nothing a test does to it can disturb the shared node (the machine's broker) or other test runs.

Lifecycle and leak protection:

- ``start()`` spawns the packaged ``rabbitmq-server`` script in the foreground, in its own session,
  as user ``rabbitmq`` when the caller is root (as the caller otherwise).
- ``kill()`` sends SIGKILL to the beam process named in the pid file (after flushing Mnesia's log,
  see its docstring); data stays for ``restart()``.
- ``stop()`` stops the node (SIGTERM, then SIGKILL) and removes its directory.
- A node whose owner process dies anyway is caught three ways: an ``atexit`` hook, a parent-death
  signal on the node's launcher (``setpriv --pdeathsig``, when started from the main thread), and a
  sweep of the node base directory that stops nodes whose owner is gone, run whenever a new
  ``DisposableBroker`` starts for the first time.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pwd
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from support.broker import AMQP_DEFAULT_PORT
from support.timeline import record_command

__all__ = [
    "DEFAULT_DISK_FREE_LIMIT",
    "DEFAULT_MEMORY_HIGH_WATERMARK",
    "KEEP_DIR_ENV",
    "BrokerCommandError",
    "BrokerStartError",
    "DisposableBroker",
    "TlsListener",
    "run_erl_call",
    "run_node_command",
]

# The relative memory watermark the node is configured with; the fixtures restore it after a test
# raised an alarm with `set_vm_memory_high_watermark`.
#: plugins every disposable node starts with: the consistent-hash exchange (partitioned consumers)
DEFAULT_PLUGINS = ("rabbitmq_consistent_hash_exchange",)
DEFAULT_MEMORY_HIGH_WATERMARK = "0.4"
# `set_disk_free_limit` counterpart. A tiny limit: a nearly full disk on a developer machine must
# not block publishers in tests that did not ask for a disk alarm.
DEFAULT_DISK_FREE_LIMIT = "1MB"
# ctl commands that change node-wide limits until the next restart, with the arguments that
# restore the configured value; see `reset_limits()`.
_LIMIT_DEFAULTS = {
    "set_vm_memory_high_watermark": (DEFAULT_MEMORY_HIGH_WATERMARK,),
    "set_disk_free_limit": (DEFAULT_DISK_FREE_LIMIT,),
}
# Set to 1 to keep a node's directory (logs, data) after stop(), to read why a test failed.
KEEP_DIR_ENV = "RELIABLE_AMQP_KEEP_NODE_DIR"

_DEBIAN_SCRIPTS = Path("/usr/lib/rabbitmq/bin")
_NODE_USER = "rabbitmq"
_OWNER_FILE = "owner"

_counter = itertools.count(1)
_live: weakref.WeakSet[DisposableBroker] = weakref.WeakSet()
_ports_in_use: set[int] = set()
_ports_lock = threading.Lock()


@dataclass(frozen=True)
class TlsListener:
    """A TLS listener for a :class:`DisposableBroker`: PEM files, copied into the node's directory.

    ``verify_peer`` makes the node ask for a client certificate signed by ``ca_file`` and refuse
    clients without one (``ssl_options.verify = verify_peer``, ``fail_if_no_peer_cert = true``).
    """

    ca_file: str | Path
    cert_file: str | Path
    key_file: str | Path
    verify_peer: bool = False


class BrokerStartError(RuntimeError):
    """The node did not come up; the message carries the tail of its logs."""


class BrokerCommandError(RuntimeError):
    """A command against the node (rabbitmqctl, erl_call) failed; ``command`` names the tool."""

    def __init__(self, command: tuple[str, ...], returncode: int, stdout: str, stderr: str) -> None:
        super().__init__(f"{' '.join(command)} exited {returncode}:\n{stdout}{stderr}".rstrip())
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def run_node_command(
    command: list[str],
    label: tuple[str, ...],
    *,
    env: Mapping[str, str],
    timeout: float,
    input: str | None = None,
    cwd: Path | None = None,
    identity: tuple[int | None, int | None, list[int] | None] = (None, None, None),
) -> subprocess.CompletedProcess[str]:
    """Run a command against a node (rabbitmqctl, erl_call) as ``identity`` (user, group, extra
    groups; None keeps ours), its output captured; recorded for the timeline as ``label``."""
    user, group, extra_groups = identity
    began = time.time()
    try:
        return subprocess.run(
            command,
            input=input,
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            user=user,
            group=group,
            extra_groups=extra_groups,
        )
    finally:
        record_command(label, began)


def run_erl_call(
    erl_call: list[str],
    node: str,
    expressions: str,
    *,
    env: Mapping[str, str],
    timeout: float,
    cwd: Path | None = None,
    identity: tuple[int | None, int | None, list[int] | None] = (None, None, None),
) -> str:
    """Evaluate ``expressions`` on ``node`` with ``erl_call`` (the command that runs it); the
    value's text (what follows ``{ok, ``). Raises BrokerCommandError on a non-zero exit or an
    ``{error, ...}`` answer (an exception, a syntax error)."""
    # -R: a name for erl_call's own hidden node from the peer. Without it every erl_call is
    # c17@host, and two at once on one node (a listing thread beside the test) refuse each other.
    command = [*erl_call, "-R", "-sname", node, "-e"]
    result = run_node_command(
        command,
        ("erl_call", expressions[:40]),
        input=expressions + "\n",  # a form ends with a full stop and a newline
        env=env,
        cwd=cwd,
        timeout=timeout,
        identity=identity,
    )
    out = result.stdout.strip()
    if result.returncode != 0 or not (out.startswith("{ok, ") and out.endswith("}")):
        raise BrokerCommandError(
            ("erl_call -e", expressions), result.returncode, result.stdout, result.stderr
        )
    return out[len("{ok, ") : -1]


class DisposableBroker:
    """A private RabbitMQ node on free loopback ports, with its data in a temporary directory.

    Usable as a context manager (``start()`` on enter, ``stop()`` on exit). All lifecycle methods
    are serialised by a lock, so a helper thread may ``kill()`` the node while the test publishes.
    """

    def __init__(
        self,
        *,
        base_dir: str | Path | None = None,
        scripts_dir: str | Path | None = None,
        extra_config: Mapping[str, str] | None = None,
        tls: TlsListener | None = None,
        plugins: tuple[str, ...] = DEFAULT_PLUGINS,
    ) -> None:
        """Prepare (but do not start) a node.

        Args:
            base_dir: parent of the node's directory; default ``<tmp>/reliable-amqp-nodes-<uid>``.
                It must be traversable by user ``rabbitmq`` when running as root.
            scripts_dir: where ``rabbitmq-server`` and ``rabbitmqctl`` live; default the Debian
                package's ``/usr/lib/rabbitmq/bin``, else the scripts found on ``PATH``.
            extra_config: additional ``rabbitmq.conf`` keys, e.g. ``{"heartbeat": "5"}``.
            tls: a TLS listener besides the plain one, on :attr:`tls_port` (None: plain only).
            plugins: the plugins enabled at start (default: the consistent-hash exchange, which
                partitioned consumers need; ``()`` for a node without it).
        """
        self._base_dir = Path(base_dir) if base_dir else _default_base_dir()
        self._scripts_dir = Path(scripts_dir) if scripts_dir else _find_scripts_dir()
        self._extra_config = dict(extra_config or {})
        self._tls = tls
        self._plugins = tuple(plugins)
        self._tls_port = 0
        short = f"ra-test-{os.getpid()}-{next(_counter)}-{secrets.token_hex(2)}"
        self.nodename = f"{short}@localhost"
        self.dir = self._base_dir / short
        self._user = _node_user()
        self._port = 0
        self._dist_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self._created = False
        self._log_read = 0  # how far _logged_startup() has read the log
        self._changed_limits: set[str] = set()
        self.last_start_seconds: float | None = None

    # -- public surface -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The AMQP port (stable across ``kill()``/``restart()``); 0 before the first start."""
        return self._port

    @property
    def tls_port(self) -> int:
        """The TLS (``amqps://``) port when the node was given a :class:`TlsListener`, else 0."""
        return self._tls_port

    def tls_url(self, host: str = "localhost") -> str:
        """``amqps://guest:guest@HOST:TLS_PORT/%2F`` (guest may log in from loopback only)."""
        return f"amqps://guest:guest@{host}:{self._tls_port}/%2F"

    @property
    def dist_port(self) -> int:
        """The Erlang distribution port of the node."""
        return self._dist_port

    @property
    def url(self) -> str:
        """``amqp://guest:guest@127.0.0.1:PORT/%2F`` for this node."""
        return f"amqp://guest:guest@127.0.0.1:{self._port}/%2F"

    @property
    def pid(self) -> int | None:
        """The beam process id while the node runs, else None."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                return None
            return _read_pid(self.dir / "rabbit.pid")

    @property
    def log_file(self) -> Path:
        """The node's main log file: read it when a test fails for an unclear reason."""
        return self.dir / "log" / f"{self.nodename}.log"

    def is_running(self) -> bool:
        """Whether the node process is alive (it may still be booting)."""
        with self._lock:
            return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 60.0) -> None:
        """Start the node and return once it accepts AMQP connections and ``await_startup`` passes.

        Starting a running node does nothing. After ``kill()`` this reuses the data directory, so
        durable queues and persistent messages come back.
        """
        with self._lock:
            if self.is_running():
                return
            began = time.monotonic()
            if not self._created:
                _reap_stale_nodes(self._base_dir)
                self._create_layout()
            self._reap()
            with contextlib.suppress(FileNotFoundError):
                (self.dir / "rabbit.pid").unlink()
            self._spawn()
            try:
                self._await_startup(began + timeout)
            except BaseException:
                self._kill_process()
                raise
            self._changed_limits.clear()  # runtime limits do not survive a restart
            self.last_start_seconds = time.monotonic() - began

    def kill(self, timeout: float = 30.0, *, sync_metadata: bool = True) -> None:
        """SIGKILL the beam process (from the pid file) and wait until its AMQP port is closed.

        The data directory stays, so ``restart()`` recovers what the node had written to disk.

        With ``sync_metadata`` (the default) the node first writes its Mnesia transaction log to
        disk (``mnesia:sync_log()``, about 0.8 s). RabbitMQ 3.x holds the last ~2 s of schema
        changes (queue, exchange and binding declarations) in disk_log's in-memory write cache,
        so a kill -9 just after a declare can lose a durable queue, and with it the confirmed
        messages in it. Pass False for the raw crash.
        """
        with self._lock:
            if not self.is_running():
                return
            if sync_metadata:
                self.sync_metadata(min(timeout, 15.0))
            self._kill_process(timeout)
            _wait_until(lambda: not _port_open(self._port), timeout, "AMQP port to close")

    def sync_metadata(self, timeout: float = 15.0) -> None:
        """Write the node's Mnesia transaction log to disk (``mnesia:sync_log()``): the
        declarations made so far survive a kill -9. Best effort: a node too sick to answer is
        left as it is.

        A test whose kill must strike mid-stream calls this before the stream and then
        ``kill(sync_metadata=False)``: the CLI call takes seconds on a loaded machine, long
        enough for a stream to end before the kill lands.
        """
        with contextlib.suppress(BrokerCommandError, subprocess.TimeoutExpired):
            self.erl("mnesia:sync_log().", timeout=timeout)

    def restart(self, timeout: float = 60.0) -> None:
        """Start the node again on the same ports and data (stopping it cleanly first if needed)."""
        with self._lock:
            if self.is_running():
                self._terminate(timeout)
            self.start(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node (SIGTERM, SIGKILL after ``timeout``) and delete its directory.

        The directory stays when the environment has RELIABLE_AMQP_KEEP_NODE_DIR=1 (until the
        next run's sweep of stale nodes removes it). Idempotent; safe on a node that never
        started or was killed.
        """
        with self._lock:
            try:
                if self.is_running():
                    self._terminate(timeout)
                self._reap()
            finally:
                if os.environ.get(KEEP_DIR_ENV) != "1":
                    shutil.rmtree(self.dir, ignore_errors=True)
                self._created = False
                _live.discard(self)
                with _ports_lock:
                    _ports_in_use.difference_update({self._port, self._dist_port, self._tls_port})

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n NODE *args`` with the node's cookie and return its stdout.

        Raises BrokerCommandError on a non-zero exit. Example:
        ``broker.ctl("set_vm_memory_high_watermark", "0.0000001")`` raises a memory alarm.
        That one goes through :meth:`erl` (the function rabbitmqctl calls, without a BEAM of its
        own) when ``erl_call`` is installed.
        """
        if args and args[0] in _LIMIT_DEFAULTS:
            # Remembered so that `reset_limits()` undoes only what was changed: a CLI call costs
            # most of a second.
            if tuple(args[1:]) == _LIMIT_DEFAULTS[args[0]]:
                self._changed_limits.discard(args[0])
            else:
                self._changed_limits.add(args[0])
            if args[0] == "set_vm_memory_high_watermark" and len(args) == 2 and self._erl_call():
                fraction = format(float(args[1]), ".12f")  # Erlang wants digits both sides
                self.erl(f"vm_memory_monitor:set_vm_memory_high_watermark({fraction}).", timeout)
                return ""
        return self._rabbitmqctl(args, timeout)

    def erl(self, expressions: str, timeout: float = 30.0) -> str:
        """Evaluate Erlang ``expressions`` (ending in a full stop) on the node; the value's text.

        Through ``erl_call`` (a C node of Erlang's own: some milliseconds) where it is
        installed, else ``rabbitmqctl eval`` (a BEAM started for the call: 1 s of CPU, 3-5 s on
        a loaded machine; the suite made about 150 such calls). The text is the value as the
        tool prints it: ``ok``, ``3``, ``"a string"``; lists and tuples differ in spacing
        between the two. Raises BrokerCommandError if the node cannot be reached or the
        evaluation raised.
        """
        erl_call = self._erl_call()
        if not erl_call:
            return self._rabbitmqctl(("eval", expressions), timeout).strip()
        return run_erl_call(
            erl_call,
            self.nodename,
            expressions,
            env=self._env(),  # its HOME holds the node's cookie, which erl_call reads
            cwd=self.dir,
            timeout=timeout,
            identity=self._identity(),
        )

    def _erl_call(self) -> list[str]:
        """The command that runs ``erl_call`` beside this node's Erlang; empty if there is none."""
        found = shutil.which("erl_call")
        return [found] if found else []

    def _rabbitmqctl(self, args: tuple[str, ...], timeout: float) -> str:
        cmd = [str(self._scripts_dir / "rabbitmqctl"), "-n", self.nodename, *args]
        result = run_node_command(
            cmd,
            ("rabbitmqctl", *args),
            env=self._env(),
            cwd=self.dir,
            timeout=timeout,
            identity=self._identity(),
        )
        if result.returncode != 0:
            raise BrokerCommandError(
                ("rabbitmqctl", *args), result.returncode, result.stdout, result.stderr
            )
        return result.stdout

    def reset_limits(self) -> None:
        """Restore the memory watermark and disk limit if a ``ctl`` call changed them.

        Raised alarms clear with it. A restart also restores them, as ctl changes are not persisted.
        """
        if not self.is_running():
            return
        for command in sorted(self._changed_limits):
            self.ctl(command, *_LIMIT_DEFAULTS[command])

    def __enter__(self) -> DisposableBroker:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<DisposableBroker {self.nodename} port={self._port} {state}>"

    # -- internals ------------------------------------------------------------------------------

    def _create_layout(self) -> None:
        self._base_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._port, self._dist_port = _pick_ports(2)
        home = self.dir / "home"
        for sub in (home, self.dir / "mnesia", self.dir / "log"):
            sub.mkdir(parents=True)
        (self.dir / _OWNER_FILE).write_text(f"{os.getpid()} {_process_start_time(os.getpid())}\n")
        (self.dir / "enabled_plugins").write_text(f"[{','.join(self._plugins)}].\n")
        # An env file of our own: /etc/rabbitmq/rabbitmq-env.conf names the shared node.
        (self.dir / "rabbitmq-env.conf").write_text("")
        config = {
            "listeners.tcp.default": f"127.0.0.1:{self._port}",
            "vm_memory_high_watermark.relative": DEFAULT_MEMORY_HIGH_WATERMARK,
            "disk_free_limit.absolute": DEFAULT_DISK_FREE_LIMIT,
            "log.console": "false",
            "log.file.level": "info",
            # guest may log in from loopback only (the default); every client here is on 127.0.0.1.
            "loopback_users.guest": "true",
            **self._tls_config(),
            **self._extra_config,
        }
        (self.dir / "rabbitmq.conf").write_text("".join(f"{k} = {v}\n" for k, v in config.items()))
        # Without lookup=file the VM resolves "localhost" through the inet_gethost port program.
        (self.dir / "erl_inetrc").write_text("{lookup, [file, native]}.\n")
        # Our own cookie, so the node and our rabbitmqctl calls agree without touching the shared
        # node's cookie; the CLI and the node both read $HOME/.erlang.cookie.
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20).upper())
        if self._user is not None:
            uid, gid = self._user
            for path in (self.dir, *self.dir.rglob("*")):
                os.chown(path, uid, gid)
        cookie.chmod(0o400)
        self.dir.chmod(0o700)
        self._created = True
        _live.add(self)

    def _tls_config(self) -> dict[str, str]:
        tls = self._tls
        if tls is None:
            return {}
        (self._tls_port,) = _pick_ports(1)
        tls_dir = self.dir / "tls"
        tls_dir.mkdir()
        config = {"listeners.ssl.default": f"127.0.0.1:{self._tls_port}"}
        for key, source in (
            ("cacertfile", tls.ca_file),
            ("certfile", tls.cert_file),
            ("keyfile", tls.key_file),
        ):
            target = tls_dir / f"{key}.pem"
            shutil.copyfile(source, target)  # chowned with the rest of the directory
            config[f"ssl_options.{key}"] = str(target)
        config["ssl_options.verify"] = "verify_peer" if tls.verify_peer else "verify_none"
        config["ssl_options.fail_if_no_peer_cert"] = "true" if tls.verify_peer else "false"
        return config

    def _env(self) -> dict[str, str]:
        # A clean environment: inherited RABBITMQ_*/ERL_* variables could point at the shared node.
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"),
            "HOME": str(self.dir / "home"),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "ERL_INETRC": str(self.dir / "erl_inetrc"),
            "ERL_CRASH_DUMP": str(self.dir / "log" / "erl_crash.dump"),
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self._port),
            "RABBITMQ_DIST_PORT": str(self._dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbit.pid"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            # Distribution only on loopback, like the shared node; schedulers that sleep when
            # idle rather than spin (2 cores shared with the suite, its JVMs and other nodes)
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}"
            " +sbwt none +sbwtdcpu none +sbwtdio none",
        }
        return env

    def _identity(self) -> tuple[int | None, int | None, list[int] | None]:
        # (user, group, extra_groups) for subprocess: None keeps the caller's identity.
        if self._user is None:
            return None, None, None
        uid, gid = self._user
        return uid, gid, []

    def _mark_log(self) -> None:
        """Remember where the log ends before the node starts (it is appended to on restart):
        :meth:`_await_startup` looks for the startup line after that."""
        try:
            self._log_read = self.log_file.stat().st_size
        except FileNotFoundError:
            self._log_read = 0

    def _logged_startup(self) -> bool:
        """Whether the node logged ``Server startup complete`` since :meth:`_mark_log` (read on
        from where the last look stopped)."""
        start = max(0, self._log_read - len(_STARTED))  # (a line the last look cut in two)
        try:
            with open(self.log_file, "rb") as log:
                log.seek(start)
                text = log.read()
        except FileNotFoundError:
            return False
        self._log_read = start + len(text)
        return _STARTED in text

    def _spawn(self) -> None:
        self._mark_log()
        cmd = [str(self._scripts_dir / "rabbitmq-server")]
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            # If the test process dies without cleaning up, the launcher script gets SIGTERM and
            # stops the node. The signal fires when the spawning *thread* exits, hence main only.
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        user, group, extra_groups = self._identity()
        with open(self.dir / "startup.log", "ab") as out:
            self._proc = subprocess.Popen(
                cmd,
                env=self._env(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C meant for pytest must not reach the node before the
                # fixtures' teardown does.
                start_new_session=True,
                user=user,
                group=group,
                extra_groups=extra_groups,
            )

    def _await_startup(self, deadline: float) -> None:
        proc = self._proc
        assert proc is not None
        # Its AMQP port, then the node's own line that its boot ended (what ``rabbitmqctl
        # await_startup`` waits for), read from its log: a CLI call boots a BEAM of its own,
        # about a second of CPU each.
        steps: tuple[tuple[str, Callable[[], bool]], ...] = (
            ("open its port", lambda: _port_open(self._port)),
            (f"log {_STARTED.decode()!r}", self._logged_startup),
        )
        for what, done in steps:
            while not done():
                if proc.poll() is not None:
                    raise BrokerStartError(
                        f"{self.nodename} exited with {proc.returncode} while starting\n"
                        f"{self._tail()}"
                    )
                if time.monotonic() > deadline:
                    raise BrokerStartError(f"{self.nodename} did not {what}\n{self._tail()}")
                time.sleep(0.05)

    def _tail(self, lines: int = 30) -> str:
        parts = []
        for path in (self.dir / "startup.log", self.log_file):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path} ---\n" + "\n".join(text))
        return "\n".join(parts)

    def _kill_process(self, timeout: float = 30.0) -> None:
        proc = self._proc
        if proc is None:
            return
        beam = _read_pid(self.dir / "rabbit.pid")
        if beam is not None and _is_child_of(beam, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(beam, signal.SIGKILL)
        else:
            # Killed while booting, before the pid file was written: take the whole group down.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        # The launcher script traps SIGTERM and forwards it to the VM, which stops rabbit cleanly.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill_process(timeout)
        _wait_until(lambda: not _port_open(self._port), timeout, "AMQP port to close")

    def _reap(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None


# -- module helpers ---------------------------------------------------------------------------


#: what a RabbitMQ node (3.x and 4.x) logs once its boot is over
_STARTED = b"Server startup complete"


def _find_scripts_dir() -> Path:
    # Debian's /usr/sbin wrappers re-exec through `su` and send output to /var/log/rabbitmq, so
    # the real scripts behind them are preferred.
    if (_DEBIAN_SCRIPTS / "rabbitmq-server").exists():
        return _DEBIAN_SCRIPTS
    found = shutil.which("rabbitmq-server")
    if found is None:
        raise BrokerStartError("rabbitmq-server is not installed (apt-get install rabbitmq-server)")
    return Path(found).resolve().parent


def _default_base_dir() -> Path:
    tmp = Path(tempfile.gettempdir())
    # The node user must be able to traverse the parent; a private TMPDIR of root's would not do.
    if tmp.stat().st_mode & 0o001 == 0:
        tmp = Path("/tmp")
    return tmp / f"reliable-amqp-nodes-{os.geteuid()}"


def _node_user() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(_NODE_USER)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def _pick_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range.

    A port from the ephemeral range could be taken, while the node is down between kill() and
    restart(), as the local port of some outgoing connection (the proxy makes plenty of them).
    """
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    upper = min(low, 32768) - 1
    lower = 20000 if upper > 21000 else 1024
    # Well-known RabbitMQ ports: epmd, AMQP and AMQPS, management (AMQP + 10000), distribution
    # (AMQP + 20000), STOMP, and the range rabbitmqctl itself listens on (distribution + 10000).
    amqp = AMQP_DEFAULT_PORT
    reserved = {4369, amqp - 1, amqp, amqp + 10000, amqp + 20000, 61613}
    reserved.update(range(amqp + 30000, amqp + 30011))
    chosen: list[int] = []
    with _ports_lock:
        for _ in range(10_000):
            port = random.randint(lower, upper)
            if port in reserved or port in _ports_in_use or port in chosen:
                continue
            if _bindable(port):
                chosen.append(port)
                if len(chosen) == count:
                    _ports_in_use.update(chosen)
                    return chosen
    raise BrokerStartError("no free port found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_child_of(pid: int, parent: int) -> bool:
    try:
        return psutil.Process(pid).ppid() == parent
    except psutil.Error:  # gone
        return False


def _process_start_time(pid: int) -> str:
    """When ``pid`` started: paired with the pid, it identifies a process despite pid reuse."""
    try:
        return repr(psutil.Process(pid).create_time())
    except psutil.Error:
        return "?"


def _owner_alive(pid: int, started: str) -> bool:
    """Whether the process that wrote an owner file (``pid``, started at ``started``) runs."""
    if "." not in started:  # written in /proc's clock ticks by an older harness: the pid alone
        return psutil.pid_exists(pid)
    return _process_start_time(pid) == started


def _process_env_has(pid: int, name: str, value: str) -> bool:
    try:
        return psutil.Process(pid).environ().get(name) == value
    except psutil.Error:
        return False


def _reap_stale_nodes(base_dir: Path) -> None:
    """Stop and delete nodes left behind by test processes that died without cleaning up."""
    if not base_dir.is_dir():
        return
    for node_dir in base_dir.iterdir():
        try:
            owner_pid, owner_start = (node_dir / _OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if _owner_alive(int(owner_pid), owner_start):
            continue  # its owner is alive: not ours to touch
        beam = _read_pid(node_dir / "rabbit.pid")
        if beam is not None and psutil.pid_exists(beam):
            # Only a process whose environment names this node: the pid may have been reused.
            if not _process_env_has(beam, "RABBITMQ_NODENAME", f"{node_dir.name}@localhost"):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(beam, signal.SIGKILL)
        shutil.rmtree(node_dir, ignore_errors=True)


@atexit.register
def _stop_all_live() -> None:
    for broker in list(_live):
        with contextlib.suppress(Exception):
            broker.stop(timeout=10.0)
