"""RabbitMQ 4 nodes and a three-node cluster beside the machine's broker, for tests.

The nodes run Debian's own rabbitmq-server package from a minimal Debian root that
``scripts/rabbitmq4.sh`` builds and caches (debootstrap; ``ensure`` is a stamp check when the
root is current). Each node runs under ``chroot`` in a private mount namespace (``unshare``: the
root's ``/proc`` and ``/dev`` mounts vanish with the node), with its own node name, AMQP and
distribution ports, data directory, Erlang cookie and its own epmd port (``ERL_EPMD_PORT``): the
machine's RabbitMQ (its AMQP, distribution and epmd ports) is never touched.

:class:`Rabbitmq4Node` is :class:`~harness.node.DisposableBroker` with another launcher, so the
fault fixtures can hand a 4.x node to the tests written for the 3.10 one (kill -9, restart,
memory alarm through ``ctl``). :class:`Rabbitmq4Cluster` starts three of them at once with
classic peer discovery, so they form one cluster on first boot; a killed or restarted node rejoins
from its data. Nodes are also ``freeze()``-able (SIGSTOP: a node that answers nothing and closes
nothing) and ``thaw()``-able.

Leak protection is the one of ``harness.node``: a parent-death signal on each launcher, an
``atexit`` hook, and a sweep of stale node directories (and epmd daemons) whose owner is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import psutil

from .node import (
    DEFAULT_PLUGINS,
    BrokerCommandError,
    BrokerStartError,
    DisposableBroker,
    TlsListener,
    _pick_ports,
    _port_open,
    _reap_stale_nodes,
    _wait_until,
    run_node_command,
)

__all__ = [
    "ROOT_ENV",
    "Rabbitmq4Cluster",
    "Rabbitmq4Node",
    "ensure_root",
    "process_state",
    "versions",
]

_REPO = Path(__file__).resolve().parents[2]
#: a prepared root to use instead of running ``scripts/rabbitmq4.sh ensure``
ROOT_ENV = "RELIABLE_AMQP_RABBITMQ4_ROOT"
#: where node directories live, inside the root (the chroot sees them at the same path minus it)
_NODES = Path("var/lib/reliable-amqp-nodes")
_SCRIPTS = Path("/usr/lib/rabbitmq/bin")
# The names of the cluster's nodes running RabbitMQ as one node sees them (cluster_status's
# running_nodes), comma-separated, for DisposableBroker.erl.
_RUNNING_NODES = (
    'lists:flatten(lists:join(",", [atom_to_list(N) || N <- rabbit_nodes:list_running()])).'
)
_root_lock = threading.Lock()
_epmds: weakref.WeakSet[_Epmd] = weakref.WeakSet()


def ensure_root() -> Path:
    """The RabbitMQ 4 root: built (or checked) by ``scripts/rabbitmq4.sh ensure`` once a process."""
    with _root_lock:
        return _find_root()


@functools.cache
def _find_root() -> Path:
    given = os.environ.get(ROOT_ENV)
    if given:
        root = Path(given)
    else:
        run = subprocess.run(
            ["bash", str(_REPO / "scripts" / "rabbitmq4.sh"), "ensure"],
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise BrokerStartError(
                f"scripts/rabbitmq4.sh ensure failed ({run.returncode}):\n{run.stderr}"
            )
        root = Path(run.stdout.strip().splitlines()[-1])
    if not (root / _SCRIPTS.relative_to("/") / "rabbitmq-server").exists():
        raise BrokerStartError(f"{root} holds no rabbitmq-server ({ROOT_ENV}?)")
    return root


def versions(root: Path | None = None) -> dict[str, str]:
    """{"rabbitmq-server": "4.3.6-1", "erlang-base": "1:29.1.1+dfsg-1"} as installed in the root."""
    root = root or ensure_root()
    out: dict[str, str] = {}
    for line in (root / ".reliable-amqp-versions").read_text().splitlines():
        name, _, version = line.partition(" ")
        out[name] = version
    return out


def _in_root(root: Path, command: Sequence[str]) -> list[str]:
    """``command`` run in ``root`` under chroot, with /proc and /dev mounted privately."""
    script = 'mount -t proc proc "$0/proc" && mount --rbind /dev "$0/dev" && exec chroot "$0" "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script,
            str(root), *command]  # fmt: skip


class _Epmd:
    """An epmd of our own on a free port, in the foreground (so we can stop it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (self.port,) = _pick_ports(1)
        erts = sorted((root / "usr/lib/erlang").glob("erts-*"))[-1]
        epmd = "/" + str((erts / "bin" / "epmd").relative_to(root))
        cmd = ["chroot", str(root), epmd, "-port", str(self.port)]
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait_until(lambda: _port_open(self.port), 10.0, f"epmd on port {self.port}")
        _epmds.add(self)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        _epmds.discard(self)


class Rabbitmq4Node(DisposableBroker):
    """A disposable RabbitMQ 4 node run from the cached Debian root (see the module docstring).

    Same surface as :class:`DisposableBroker` (``url``, ``port``, ``start``, ``kill``,
    ``restart``, ``stop``, ``ctl``, ``reset_limits``), plus ``freeze()``/``thaw()``. A lone node
    gets an epmd of its own; cluster members share the cluster's.
    """

    def __init__(
        self,
        *,
        root: Path | None = None,
        extra_config: Mapping[str, str] | None = None,
        cookie: str | None = None,
        epmd_port: int | None = None,
        short_name: str | None = None,
        tls: TlsListener | None = None,
        plugins: tuple[str, ...] = DEFAULT_PLUGINS,
    ) -> None:
        """Prepare (but do not start) a node in ``root`` (default: :func:`ensure_root`)."""
        if tls is not None:
            raise NotImplementedError("Rabbitmq4Node has no TLS listener")
        self.root = root or ensure_root()
        super().__init__(
            base_dir=self.root / _NODES,
            scripts_dir=self.root / _SCRIPTS.relative_to("/"),
            extra_config=extra_config,
            plugins=plugins,
        )
        if short_name is not None:
            self.nodename = f"{short_name}@localhost"
            self.dir = self._base_dir / short_name
        self._user = None  # root inside the chroot: the files are ours, no su
        self._cookie = cookie or secrets.token_hex(20).upper()
        self._own_epmd: _Epmd | None = None
        self._epmd_port = epmd_port or 0
        self.frozen = False
        self._frozen_pid: int | None = None  # the process freeze() stopped
        self._began = 0.0
        #: bumped by every start, kill, freeze, thaw and stop: a cluster whose nodes' counts are
        #: those it last saw converge needs no look (Rabbitmq4Cluster.await_members)
        self.changes = 0

    @property
    def epmd_port(self) -> int:
        """The epmd port the node registers with (0 before the first start)."""
        return self._epmd_port

    def start(self, timeout: float = 90.0) -> None:
        """Start the node (and a lone node's epmd); see :meth:`DisposableBroker.start`."""
        with self._lock:
            if not self._epmd_port:
                self._own_epmd = _Epmd(self.root)
                self._epmd_port = self._own_epmd.port
            self.frozen = False
            super().start(timeout)

    def launch(self) -> None:
        """Spawn the node and return at once; :meth:`wait_started` waits for it. ``start()`` is
        the two together. Several nodes launched before any is awaited boot in parallel."""
        with self._lock:
            if not self._epmd_port:
                self._own_epmd = _Epmd(self.root)
                self._epmd_port = self._own_epmd.port
            self.frozen = False
            if self.is_running():
                return
            self._began = time.monotonic()
            if not self._created:
                _reap_stale_nodes(self._base_dir)
                self._create_layout()
            self._reap()
            with contextlib.suppress(FileNotFoundError):
                (self.dir / "rabbit.pid").unlink()
            self._spawn()

    def wait_started(self, timeout: float = 90.0) -> None:
        """Wait until a launched node accepts AMQP connections and ``await_startup`` passes."""
        with self._lock:
            try:
                self._await_startup(self._began + timeout)
            except BaseException:
                self._kill_process()
                raise
            self._changed_limits.clear()
            self.last_start_seconds = time.monotonic() - self._began

    def kill(self, timeout: float = 30.0, *, sync_metadata: bool = False) -> None:
        """SIGKILL the beam process. RabbitMQ 4 keeps its metadata in Khepri (a Raft log written
        before it answers), so there is no Mnesia log to flush first: ``sync_metadata`` is
        accepted for the 3.10 node's signature and ignored."""
        with self._lock:
            self.thaw()
            self.changes += 1
            super().kill(timeout, sync_metadata=False)

    def freeze(self, timeout: float = 10.0) -> None:
        """SIGSTOP the beam process: its sockets stay open and nothing answers.

        The process stopped is the one listening on the node's AMQP port: the pid file's,
        or, should the two differ, the listener when it is a beam process this node's launcher
        started (anything else raises, and nothing is stopped). Returns once every thread of it
        is stopped (a thread in an uninterruptible wait stops when it leaves it).
        """
        with self._lock:
            pid = self.pid
            if pid is None:
                raise BrokerStartError(f"{self.nodename} is not running")
            listeners = _listeners(self.port)
            if listeners and pid not in listeners:
                launcher = self._proc.pid if self._proc is not None else -1
                ours = [p for p in listeners if _beam_under(p, launcher)]
                if len(ours) != 1:
                    raise BrokerStartError(
                        f"{self.nodename}: port {self.port} is served by {sorted(listeners)}, "
                        f"not by its beam process {pid} (pid file)"
                    )
                pid = ours[0]
            os.kill(pid, signal.SIGSTOP)
            self._frozen_pid = pid
            self.frozen = True
            self.changes += 1
            _wait_until(lambda: _all_threads_stopped(pid), timeout, f"{self.nodename} to stop")

    def thaw(self) -> None:
        """SIGCONT a frozen node (nothing when it is not frozen)."""
        with self._lock:
            pid = self._frozen_pid
            if self.frozen and pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                self.changes += 1
            self.frozen = False
            self._frozen_pid = None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the node (thawed first), delete its directory, stop its own epmd."""
        with self._lock:
            self.thaw()
            self.changes += 1
            try:
                super().stop(timeout)
            finally:
                if self._own_epmd is not None:
                    self._own_epmd.stop()
                    self._own_epmd = None
                    self._epmd_port = 0

    def _rabbitmqctl(self, args: tuple[str, ...], timeout: float) -> str:
        return self.tool("rabbitmqctl", *args, timeout=timeout)

    def _erl_call(self) -> list[str]:
        # The root's own, as its Erlang (OTP 27+) may refuse a handshake from the host's older one.
        inner = "/usr/bin/erl_call"
        return ["chroot", str(self.root), inner] if (self.root / inner[1:]).exists() else []

    def client_connections(self) -> int:
        """Client connections on this node's AMQP port, as the node lists them (what
        ``rabbitmqctl list_connections port`` shows, counted; a connection closing meanwhile is
        not counted)."""
        return int(
            self.erl(
                "length([P || P <- rabbit_networking:connections(), "
                "case catch rabbit_networking:connection_info(P, [port]) of "
                f"[{{port, {self.port}}}] -> true; _ -> false end])."
            )
        )

    def tool(self, name: str, *args: str, timeout: float = 60.0) -> str:
        """Run one of the root's CLI tools (``rabbitmqctl``, ``rabbitmq-queues``, ...) against
        the node; its stdout. Raises :class:`BrokerCommandError` on a non-zero exit."""
        cmd = ["chroot", str(self.root), str(_SCRIPTS / name), "-n", self.nodename, *args]
        result = run_node_command(cmd, (name, *args), env=self._env(), timeout=timeout)
        if result.returncode != 0:
            raise BrokerCommandError((name, *args), result.returncode, result.stdout, result.stderr)
        return result.stdout

    # -- DisposableBroker hooks -----------------------------------------------------------------

    def _create_layout(self) -> None:
        super()._create_layout()
        cookie = self.dir / "home" / ".erlang.cookie"
        cookie.chmod(0o600)
        cookie.write_text(self._cookie)
        cookie.chmod(0o400)

    def _inner(self, path: Path) -> str:
        return "/" + str(path.relative_to(self.root))

    def _env(self) -> dict[str, str]:
        env = {
            key: (self._inner(Path(value)) if value.startswith(str(self.root)) else value)
            for key, value in super()._env().items()
        }
        env["PATH"] = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
        env["ERL_EPMD_PORT"] = str(self._epmd_port)
        return env

    def _spawn(self) -> None:
        self.changes += 1
        self._mark_log()
        cmd = _in_root(self.root, [str(_SCRIPTS / "rabbitmq-server")])
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        with open(self.dir / "startup.log", "ab") as out:
            self._proc = subprocess.Popen(
                cmd,
                env=self._env(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> Rabbitmq4Node:
        super().__enter__()
        return self

    def __repr__(self) -> str:
        state = "frozen" if self.frozen else "running" if self.is_running() else "stopped"
        return f"<Rabbitmq4Node {self.nodename} port={self.port} {state}>"


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T``) in /proc."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise BrokerStartError(f"process {pid} ended while being frozen") from None
    for task in tasks:
        try:
            state = process_state(pid, task)
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


def process_state(pid: int, task: str | None = None) -> str:
    """The state letter /proc gives process ``pid`` (or its thread ``task``): ``T`` stopped."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    with open(path) as stat:
        # "pid (comm) S ...": the state follows the last ')' (comm may hold one).
        return stat.read().rpartition(")")[2].split()[0]


def _beam_under(pid: int, launcher: int) -> bool:
    """Whether ``pid`` is a beam process started (at any depth) by the process ``launcher``."""
    try:
        process = psutil.Process(pid)
        return process.name() == "beam.smp" and launcher in {p.pid for p in process.parents()}
    except psutil.Error:
        return False


def _listeners(port: int) -> set[int]:
    """The processes with a TCP socket listening on ``port`` (empty when /proc tells nothing)."""
    with contextlib.suppress(psutil.Error, OSError):
        return {
            conn.pid
            for conn in psutil.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN
            and conn.pid
            and conn.laddr
            and conn.laddr.port == port
        }
    return set()


class Rabbitmq4Cluster:
    """``size`` RabbitMQ 4 nodes forming one cluster (classic peer discovery), one epmd.

    A context manager: ``start()`` on enter (all nodes boot at once, about 15 s), ``stop()`` on
    exit. ``urls`` lists every node's AMQP URL, in node order.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        root: Path | None = None,
        extra_config: Mapping[str, str] | None = None,
    ) -> None:
        """Prepare (but do not start) the cluster."""
        self.root = root or ensure_root()
        self._epmd: _Epmd | None = None
        self._size = size
        self._extra_config = dict(extra_config or {})
        self.nodes: list[Rabbitmq4Node] = []
        self.last_start_seconds: float | None = None
        self._converged: list[int] | None = None  # the nodes' changes when last converged

    @property
    def urls(self) -> list[str]:
        """Every node's ``amqp://guest:guest@127.0.0.1:PORT/%2F``, in node order."""
        return [node.url for node in self.nodes]

    def start(self, timeout: float = 120.0) -> None:
        """Start every node at once and wait until the cluster reports all of them running."""
        began = time.monotonic()
        self._epmd = _Epmd(self.root)
        tag = f"ra4c-{os.getpid()}-{secrets.token_hex(2)}"
        names = [f"{tag}-{i}" for i in range(1, self._size + 1)]
        cookie = secrets.token_hex(20).upper()
        peers = {
            f"cluster_formation.classic_config.nodes.{i}": f"{name}@localhost"
            for i, name in enumerate(names, 1)
        }
        self.nodes = [
            Rabbitmq4Node(
                root=self.root,
                cookie=cookie,
                epmd_port=self._epmd.port,
                short_name=name,
                extra_config={**peers, **self._extra_config},
            )
            for name in names
        ]
        # Launched from this thread (a node launched from a helper thread would get no
        # parent-death signal: it fires when the spawning thread ends), then awaited: they boot
        # at once and find each other through classic peer discovery (one at a time, the first
        # would wait about 100 s for its peers before forming a cluster alone).
        for node in self.nodes:
            node.launch()
        for node in self.nodes:
            node.wait_started(timeout)
        self.await_members(timeout=max(10.0, timeout - (time.monotonic() - began)))
        self.last_start_seconds = time.monotonic() - began

    def await_members(self, timeout: float = 60.0) -> None:
        """Wait until every running node sees all running nodes as cluster members. Nothing to
        ask when no node was started, killed, frozen, thawed or stopped since the last time they
        did (each look is an erl_call per node; it was a rabbitmqctl call, a BEAM of its own)."""
        changes = [node.changes for node in self.nodes]
        if changes == self._converged:
            return
        want = {n.nodename for n in self.nodes if n.is_running() and not n.frozen}

        def converged() -> bool:
            for node in self.nodes:
                if node.nodename not in want:
                    continue
                try:
                    running = node.erl(_RUNNING_NODES, timeout=30)
                except (BrokerCommandError, subprocess.TimeoutExpired):
                    return False
                if not want <= set(running.strip('"').split(",")):
                    return False
            return True

        _wait_until(converged, timeout, f"cluster members {sorted(want)}")
        self._converged = changes

    def leader(self, queue: str, timeout: float = 30.0) -> Rabbitmq4Node:
        """The node holding the leader of quorum queue ``queue``, as the first running node that
        knows says. Through an election (the leader's node was just killed: RabbitMQ answers an
        empty name) or a node still booting (launched again, its commands fail or it knows no
        queue yet), it asks again until ``timeout``, then raises with every node's answer."""
        name = queue.replace("\\", "\\\\").replace('"', '\\"')
        # What list_queues' leader column shows (rabbit_amqqueue:info/2), for one queue
        expression = (
            f'case rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, <<"{name}"/utf8>>)) of '
            "{ok, Q} -> [{leader, L}] = rabbit_amqqueue:info(Q, [leader]), atom_to_list(L); "
            "_ -> none end."
        )
        found: list[Rabbitmq4Node] = []
        answers: list[str] = []  # each running node's answer, in the last round

        def known() -> bool:
            answers.clear()
            for node in self.nodes:
                if not node.is_running() or node.frozen:
                    continue
                try:
                    leader = node.erl(expression).strip('"')
                except BrokerCommandError as exc:
                    answers.append(f"{node.nodename}: {str(exc).splitlines()[-1]}")
                    continue
                found.extend(n for n in self.nodes if n.nodename == leader)
                if found:
                    return True
                said = {"none": "no such queue", "[]": "no leader known"}.get(leader, leader)
                answers.append(f"{node.nodename}: {said}")
            return False

        try:
            _wait_until(known, timeout, f"a leader of {queue}")
        except TimeoutError as exc:
            asked = "; ".join(answers) or "no running node to ask"
            raise BrokerStartError(f"{exc} ({asked})") from None
        return found[0]

    def stop(self) -> None:
        """Stop every node (thawed first), delete their directories, stop the epmd."""
        errors: list[BaseException] = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as exc:  # stop them all before reporting the first failure
                errors.append(exc)
        if self._epmd is not None:
            self._epmd.stop()
            self._epmd = None
        if errors:
            raise errors[0]

    def __enter__(self) -> Rabbitmq4Cluster:
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


@atexit.register
def _stop_epmds() -> None:
    for epmd in list(_epmds):
        with contextlib.suppress(Exception):
            epmd.stop()
