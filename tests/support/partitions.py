"""Support for the partitioned consumer's end-to-end tests (issue 46): members in processes of
their own (``tests/consumer/partition_child.py``), what the broker says about the group while
they run, and the effects they committed, checked.

- :class:`Members`: child consumers of one group sharing a record file (membership and every
  change of the partitions each holds), started, killed -9, stopped;
- :class:`ConsumerCounts`: a thread that asks the broker for every partition queue's consumer
  count (passive declares, every 50 ms) and the number of members;
- :class:`ConsumerList`: a thread that lists the broker's consumers over and over (its own list of
  subscriptions, one per channel: what ``rabbitmqctl list_consumers`` shows, asked through
  ``erl_call``);
- :func:`broker_shares`: which member holds which partition, by the broker (consumer, channel,
  connection, its ``connection_name``);
- :func:`check_effects`: every event's effect exactly once, each key's in commit order.

Waits are on conditions (a record line, a sample, a count), each bounded; no fixed sleeps.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg

from harness.node import run_erl_call
from reliable_amqp.inbox import Inbox
from support.consumer import record_lines

CHILD = Path(__file__).resolve().parents[1] / "consumer" / "partition_child.py"

#: the inbox's scope in the members
INBOX_SCOPE = "partitions"
#: the advisory lock a gated member's handlers take shared (``partition_child.py``'s ``gate``)
GATE = 46


class Gate:
    """Pauses the handlers of members started with ``gate=True``: while :meth:`close` holds
    PostgreSQL's advisory lock :data:`GATE` exclusively, each handler waits for it in its
    transaction. So a test decides where a run stands when it acts (all of its events published
    before any is handled; no effect committed between counting them and a kill), whatever the
    machine's pace: :meth:`close` returns once the transactions under way have committed."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True)

    def close(self) -> None:
        self._conn.execute("SELECT pg_advisory_lock(%s)", (GATE,))

    def open(self) -> None:
        self._conn.execute("SELECT pg_advisory_unlock(%s)", (GATE,))

    def release(self) -> None:
        """Drop the connection (and with it the lock, if held)."""
        self._conn.close()


#: the members' effects: one row per event handled (claimed), with who, where and when
EFFECTS_TABLE = """
CREATE TABLE effects (
    id bigserial PRIMARY KEY,
    message_id text NOT NULL,
    key text NOT NULL,
    seq integer NOT NULL,
    pid integer NOT NULL,
    partition integer NOT NULL,
    redelivered boolean NOT NULL,
    started double precision NOT NULL,
    at double precision NOT NULL
)
"""

#: evaluates Erlang expressions on a node of the broker and returns the value's text:
#: DisposableBroker.erl (a disposable or RabbitMQ 4 node), or :func:`local_erl`
Erl = Callable[[str], str]


@functools.cache
def _local_node() -> tuple[str, str] | None:
    """The machine's broker: its node name and the home holding its cookie (the ``rabbitmq``
    user's), for erl_call; None without erl_call or a readable cookie."""
    try:
        home = pwd.getpwnam("rabbitmq").pw_dir
    except KeyError:
        return None
    if shutil.which("erl_call") is None or not os.access(Path(home, ".erlang.cookie"), os.R_OK):
        return None
    name = _rabbitmqctl_eval("atom_to_list(node()).").strip('"')
    return name, home


def _rabbitmqctl_eval(expressions: str) -> str:
    result = subprocess.run(
        ["rabbitmqctl", "-q", "eval", expressions],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"rabbitmqctl eval {expressions}: {result.stderr or result.stdout}")
    return result.stdout.strip()


def local_erl(expressions: str) -> str:
    """``expressions`` evaluated on the machine's broker: through ``erl_call`` (milliseconds)
    with the node's own cookie, else ``rabbitmqctl eval`` (a BEAM of its own: seconds)."""
    node = _local_node()
    if node is None:
        return _rabbitmqctl_eval(expressions)
    name, home = node
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home}
    return run_erl_call(["erl_call"], name, expressions, env=env, timeout=30)


def shares(partitions: int, members: int) -> tuple[int, int]:
    """The least and the most partitions one member should hold."""
    return partitions // members, math.ceil(partitions / members)


def prepare_database(dsn: str) -> None:
    """The inbox's tables (scope ``partitions``) and the children's ``effects`` table."""
    with psycopg.connect(dsn) as conn:
        Inbox(INBOX_SCOPE).install(conn)
        conn.execute(EFFECTS_TABLE)


# --- the members ------------------------------------------------------------------------------


@dataclass
class GroupRecord:
    """What the members wrote to their shared record file."""

    #: pid -> when it became a member (monotonic)
    joined: dict[int, float] = field(default_factory=dict)
    #: pid -> [(when, the partitions it held from then on)]
    held: dict[int, list[tuple[float, list[int]]]] = field(default_factory=dict)
    exits: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def parse(cls, lines: list[str]) -> GroupRecord:
        record = cls()
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind == "MEMBER":
                pid, at = rest.split(" ")
                record.joined[int(pid)] = float(at)
            elif kind == "HELD":
                pid, at, held = rest.split(" ")
                partitions = [] if held == "-" else [int(p) for p in held.split(",")]
                record.held.setdefault(int(pid), []).append((float(at), partitions))
            elif kind == "EXIT":
                record.exits.append(json.loads(rest))
        return record

    def holding(self, pids: Sequence[int]) -> dict[int, list[int]]:
        """What each of ``pids`` holds now (by its latest report)."""
        return {pid: (self.held[pid][-1][1] if self.held.get(pid) else []) for pid in pids}

    def all_held_at(self, pids: Sequence[int], after: float, partitions: int) -> float | None:
        """The first report time after ``after`` at which ``pids`` held every partition between
        them (by their reports), or None."""
        events = sorted(
            (at, pid, held) for pid in pids for at, held in self.held.get(pid, []) if at > after
        )
        now = {pid: [h for at, h in self.held.get(pid, []) if at <= after][-1:] for pid in pids}
        state = {pid: (held[0] if held else []) for pid, held in now.items()}
        for at, pid, held in events:
            state[pid] = held
            union = [p for h in state.values() for p in h]
            if sorted(union) == list(range(partitions)):
                return at
        return None


def settled(holding: dict[int, list[int]], partitions: int) -> bool:
    """Every partition held by exactly one of the members, each within its share."""
    least, most = shares(partitions, len(holding))
    union = [p for held in holding.values() for p in held]
    return sorted(union) == list(range(partitions)) and all(
        least <= len(held) <= most for held in holding.values()
    )


class Members:
    """Child members (``partition_child.py``) of one group sharing one record file."""

    def __init__(self, place: Path, **config: Any) -> None:
        place.mkdir(parents=True, exist_ok=True)
        self.out = place / "record.txt"
        self.out.touch()
        self.stderr = place / "stderr.txt"
        self.config = {"out": str(self.out), **config}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        #: a check run on every wait: a violation it returns (say, a partition queue the broker
        #: showed with two consumers) fails the wait at once, naming it
        self.watchdog: Callable[[], str | None] = lambda: None

    def start(self, label: str) -> subprocess.Popen[bytes]:
        """Start one more member, named ``member-<label>`` on the broker."""
        config = {**self.config, "connection_name": f"member-{label}"}
        with open(self.stderr, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps(config)],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.procs[label] = proc
        return proc

    def live(self) -> dict[str, int]:
        """label -> pid of every member still running."""
        return {label: p.pid for label, p in self.procs.items() if p.poll() is None}

    def record(self) -> GroupRecord:
        return GroupRecord.parse(record_lines(self.out))

    def holding(self) -> dict[int, list[int]]:
        """pid -> partitions held, for the running members."""
        return self.record().holding(list(self.live().values()))

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> float:
        """Wait until ``predicate()``; how long it took. Fails when a member died on its own."""
        began = time.monotonic()
        while not predicate():
            violation = self.watchdog()
            if violation is not None:
                raise AssertionError(
                    f"{violation} (waiting for {what}); the members hold {self.holding()}\n"
                    f"{self.errors()}"
                )
            died = {
                label: code
                for label, code in ((label, p.poll()) for label, p in self.procs.items())
                if code is not None and code != -signal.SIGKILL
            }
            if died:
                raise AssertionError(f"members exited {died} before {what}:\n{self.errors()}")
            if time.monotonic() - began > timeout:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {what}; holding "
                    f"{self.holding()}\n{self.errors()}"
                )
            time.sleep(0.05)
        return time.monotonic() - began

    def wait_joined(self, timeout: float) -> float:
        """Wait until one member has joined (the group's topology is then declared)."""
        return self.wait(lambda: bool(self.record().joined), timeout, "a first member")

    def wait_settled(self, timeout: float, what: str) -> float:
        """Wait until the running members hold every partition, each its share."""
        partitions = int(self.config["partitions"])
        live = self.live()

        def done() -> bool:
            record = self.record()
            return set(live.values()) <= set(record.joined) and settled(
                record.holding(list(live.values())), partitions
            )

        return self.wait(done, timeout, what)

    def kill9(self, label: str) -> float:
        """SIGKILL one member and reap it; when (monotonic) the signal went."""
        proc = self.procs[label]
        at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        return at

    def terminate_all(self, timeout: float = 60.0) -> dict[str, int]:
        """SIGTERM every running member at once (a graceful stop); label -> exit code."""
        running = {label: p for label, p in self.procs.items() if p.poll() is None}
        for proc in running.values():
            proc.send_signal(signal.SIGTERM)
        return {label: proc.wait(timeout) for label, proc in running.items()}

    def errors(self, tail: int = 4000) -> str:
        text = self.stderr.read_text(errors="replace") if self.stderr.exists() else ""
        return text[-tail:]

    def log_lines(self, word: str) -> list[str]:
        """The children's stderr lines containing ``word``."""
        if not self.stderr.exists():
            return []
        return [
            line for line in self.stderr.read_text(errors="replace").splitlines() if word in line
        ]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


# --- the broker's view ------------------------------------------------------------------------


class ConsumerCounts:
    """A thread asking the broker every ``step`` seconds for each partition queue's consumer
    count and the group's number of members (passive declares on one connection). A sample it
    could not take (the node went away) is skipped; it connects again to the next URL."""

    def __init__(self, urls: Sequence[str], name: str, partitions: int, step: float = 0.05):
        self.urls = list(urls)
        self.name = name
        self.partitions = partitions
        self.step = step
        #: (monotonic time, members, [consumers of each partition])
        self.samples: list[tuple[float, int, list[int]]] = []
        #: (monotonic time, [messages ready in each partition]), sampled with the counts
        self.ready: list[tuple[float, list[int]]] = []
        self.most = [0] * partitions
        self.errors = 0
        #: the first few failures (what went wrong with a sample)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="consumer-counts", daemon=True)

    def start(self) -> ConsumerCounts:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a failed test may stop it before)
            self._thread.join(10)  # a sample stuck on a dead node: the thread is a daemon

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            url = self.urls[index % len(self.urls)]
            index += 1
            try:
                params = pika.URLParameters(url)
                params.socket_timeout = 2
                params.blocked_connection_timeout = 5
                connection = pika.BlockingConnection(params)
            except pika.exceptions.AMQPError as exc:
                self._failed(exc)
                self._stop.wait(0.2)
                continue
            try:
                channel = connection.channel()
                while not self._stop.is_set():
                    members, channel = _held_slots(connection, channel, self.name, self.partitions)
                    oks = [
                        channel.queue_declare(f"{self.name}.{i}", passive=True).method
                        for i in range(self.partitions)
                    ]
                    counts = [ok.consumer_count for ok in oks]
                    at = time.monotonic()
                    self.samples.append((at, members, counts))
                    self.ready.append((at, [ok.message_count for ok in oks]))
                    self.most = [max(a, b) for a, b in zip(self.most, counts, strict=True)]
                    self._stop.wait(self.step)
            except (pika.exceptions.AMQPError, OSError) as exc:
                self._failed(exc)  # a 404 before the first member, a node killed: try again
            finally:
                if connection.is_open:
                    with contextlib.suppress(pika.exceptions.AMQPError, OSError):
                        connection.close()

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if len(self.failures) < 20:
            self.failures.append(f"{time.monotonic():.3f} {exc!r}"[:300])

    def wait(
        self,
        predicate: Callable[[int, list[int]], bool],
        after: float,
        timeout: float,
        what: str,
    ) -> float:
        """The time of the first sample after ``after`` satisfying ``predicate(members,
        counts)`` (waiting up to ``timeout`` seconds for it)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            samples = self.samples
            for at, members, counts in samples[seen:]:
                if at > after and predicate(members, counts):
                    return at
            seen = len(samples)
            if time.monotonic() > deadline:
                last = samples[-1] if samples else None
                raise AssertionError(f"timed out after {timeout} s waiting for {what}: {last}")
            time.sleep(self.step)

    def violation(self) -> str | None:
        """The first sample with a partition queue consumed twice or more, described."""
        if max(self.most, default=0) <= 1:
            return None
        for at, members, counts in self.samples:
            if max(counts) > 1:
                doubled = [i for i, n in enumerate(counts) if n > 1]
                return (
                    f"the broker showed partition(s) {doubled} of {self.name!r} with "
                    f"{[counts[i] for i in doubled]} consumers at {at:.3f} "
                    f"(members {members}, consumers per partition {counts})"
                )
        return None

    def backlogged(self, partition: int, begin: float, end: float) -> bool:
        """Whether ``partition`` had messages ready in every sample from ``begin`` to ``end``
        (and at least one sample fell between): a pause then was the group's, not an empty
        queue's."""
        inside = [ready[partition] for at, ready in self.ready if begin <= at <= end]
        return bool(inside) and min(inside) > 0

    def gap(self, after: float) -> float | None:
        """The first sample after ``after`` where some partition had no consumer."""
        for at, _, counts in self.samples:
            if at > after and 0 in counts:
                return at
        return None


class ConsumerList:
    """A thread listing the broker's consumers (:func:`list_consumers`) every ``every`` seconds:
    for each partition queue,
    the most channels the broker ever listed as its *active* consumers at once (a consumer
    waiting behind a single active consumer is listed, inactive: it gets nothing), and how many
    listings it took. (On a quorum queue a passive declare's consumer count also counts a
    consumer cancelled with messages still unacknowledged, until they are settled; this list
    does not.)"""

    def __init__(self, erl: Erl, name: str, partitions: int, every: float = 0.1) -> None:
        self.erl = erl
        self.prefix = f"{name}."
        self.every = every
        self.queues = {f"{name}.{i}": i for i in range(partitions)}
        self.most = [0] * partitions
        #: the most consumers listed on one partition queue, active or not
        self.most_listed = 0
        self.listings = 0
        self.failures: list[str] = []
        #: listings where a partition queue had two active channels or more:
        #: (time, queue, channels)
        self.doubles: list[tuple[float, str, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="list-consumers", daemon=True)

    def start(self) -> ConsumerList:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a failed test may stop it before)
            self._thread.join(10)  # a listing stuck on a dead node: the thread is a daemon

    def violation(self) -> str | None:
        """The first listing with a partition queue actively consumed on two channels."""
        if not self.doubles:
            return None
        at, queue, channels = self.doubles[0]
        return (
            f"the broker's consumer list at {at:.3f}: {queue!r} actively consumed on channels "
            f"{channels}"
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rows = list_consumers(self.erl, self.prefix, attempts=1)
            except Exception as exc:  # a node down (the cluster test): the next listing
                self.failures.append(repr(exc)[:200])
                self._stop.wait(0.5)
                continue
            at = time.monotonic()
            active: dict[str, set[str]] = defaultdict(set)
            listed: Counter[str] = Counter()
            for row in rows:
                if row.queue in self.queues:
                    listed[row.queue] += 1
                    if row.active:
                        active[row.queue].add(row.channel)
            self.most_listed = max(self.most_listed, *listed.values(), 0)
            for queue, channels in active.items():
                index = self.queues[queue]
                self.most[index] = max(self.most[index], len(channels))
                if len(channels) > 1:
                    self.doubles.append((at, queue, sorted(channels)))
            self.listings += 1
            self._stop.wait(self.every)


#: the broker's consumers on the queues whose names start with ``Prefix`` (bound before it),
#: one row each, ``;`` between rows: queue name, channel (its node and pid), whether active,
#: and with ``Owners`` true the ``connection_name`` of the channel's connection ("?" if it
#: has none or closed meanwhile). rabbit_amqqueue:consumers/1 gives the tuples
#: ``rabbitmqctl list_consumers`` lists (channel first, active fifth), from any node of a
#: cluster; a queue that cannot answer (its leader's node down) fails the whole listing.
_CONSUMERS = (
    "Owner = fun(Ch) -> try "
    "[{connection, Conn}] = rabbit_channel:info(Ch, [connection]), "
    "[{client_properties, Props}] = rabbit_networking:connection_info(Conn, [client_properties]), "
    '{_, longstr, V} = lists:keyfind(<<"connection_name">>, 1, Props), binary_to_list(V) '
    'catch _:_ -> "?" end end, '
    'lists:flatten(lists:join(";", ['
    '[N, " ", atom_to_list(node(element(1, C))), pid_to_list(element(1, C)), " ", '
    'atom_to_list(element(5, C)), case Owners of true -> [" ", Owner(element(1, C))]; '
    "false -> [] end] "
    '|| Q <- rabbit_amqqueue:list(<<"/">>), '
    "N <- [binary_to_list(element(4, amqqueue:get_name(Q)))], lists:prefix(Prefix, N), "
    "C <- rabbit_amqqueue:consumers(Q)]))."
)


@dataclass(frozen=True)
class Listed:
    """One consumer as the broker lists it."""

    queue: str
    channel: str
    active: bool
    #: the ``connection_name`` of the channel's connection (with ``owners=True``), else None
    owner: str | None = None


def list_consumers(
    erl: Erl, prefix: str, *, owners: bool = False, attempts: int = 5
) -> list[Listed]:
    """The broker's consumers on the queues named ``prefix...``; see :data:`_CONSUMERS`.
    Tried again when it fails (a queue going or moving while it is read)."""
    quoted = prefix.replace("\\", "\\\\").replace('"', '\\"')
    expressions = f'Prefix = "{quoted}", Owners = {str(owners).lower()}, ' + _CONSUMERS
    for attempt in range(attempts):
        try:
            text = erl(expressions)
            break
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(0.2)
    if text == "[]":  # erl_call prints an empty string as the empty list
        return []
    if not (text.startswith('"') and text.endswith('"')):
        raise AssertionError(f"unexpected consumer listing: {text[:300]}")
    rows: list[Listed] = []
    for row in text[1:-1].split(";"):
        parts = row.split(" ", 3)
        rows.append(Listed(parts[0], parts[1], parts[2] == "true", parts[3] if owners else None))
    return rows


def second_subscription(url: str, queue: str, erl: Erl) -> str | None:
    """Subscribe to ``queue`` once more (exclusive, as a member takes a partition) while its
    holder runs: None when the broker refuses (403) or lists the new subscription inactive
    (behind a single active consumer), else what it did instead."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        try:
            channel.basic_consume(queue, lambda *_: None, exclusive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 403:
                return None
            return f"refused with {exc.reply_code} {exc.reply_text}"
        rows = [row for row in list_consumers(erl, queue) if row.queue == queue]
        if sum(1 for row in rows if row.active) <= 1:
            return None
        return (
            f"a second exclusive basic.consume on {queue!r} accepted and active: the broker "
            f"lists {rows}"
        )
    finally:
        if connection.is_open:
            connection.close()


def broker_shares(erl: Erl, name: str, partitions: int) -> dict[str, list[int]]:
    """By the broker: ``connection_name`` -> the partitions whose queue it has an active
    subscription on (consumers, their channels, the channels' connections and those
    connections' names)."""
    queues = {f"{name}.{i}": i for i in range(partitions)}
    held: dict[str, list[int]] = defaultdict(list)
    for row in list_consumers(erl, f"{name}.", owners=True):
        if row.active and row.queue in queues:
            held[row.owner or "?"].append(queues[row.queue])
    return {owner: sorted(parts) for owner, parts in held.items()}


# --- the effects ------------------------------------------------------------------------------


@dataclass
class Effects:
    """What :func:`check_effects` found."""

    total: int
    #: effects whose delivery was a redelivery (after a kill or a partition moving)
    redelivered: int
    #: partition -> the pids that handled it, in turn (one entry per run of effects)
    turns: dict[int, list[int]]
    #: partition -> (last effect of a turn, first effect of the next), monotonic seconds
    handovers: dict[int, list[tuple[float, float]]]


def check_effects(dsn: str, per_key: dict[str, int]) -> Effects:
    """Assert that ``effects`` holds every event of ``per_key`` (key -> its number of events,
    seq 1..n) exactly once, each key's in commit order (seq ascending by effect row id), each
    key's from one partition, and no two members handling one partition at the same time
    (the turns of a partition, in effect id order, do not overlap in time)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, message_id, key, seq, pid, partition, redelivered, started, at"
            " FROM effects ORDER BY id"
        ).fetchall()
    expected = sum(per_key.values())
    ids = Counter(row[1] for row in rows)
    twice = [m for m, n in ids.items() if n > 1]
    assert not twice, f"{len(twice)} events with two effects or more, e.g. {twice[:5]}"
    pairs = Counter((row[2], row[3]) for row in rows)
    assert max(pairs.values(), default=1) == 1, [p for p, n in pairs.items() if n > 1][:5]
    seqs: dict[str, list[int]] = defaultdict(list)
    partition_of: dict[str, set[int]] = defaultdict(set)
    for _, _, key, seq, _, partition, _, _, _ in rows:
        seqs[key].append(seq)
        partition_of[key].add(partition)
    missing = {k: n - len(seqs.get(k, [])) for k, n in per_key.items() if len(seqs.get(k, [])) < n}
    assert not missing, f"{sum(missing.values())} events without an effect: {list(missing)[:5]}"
    assert len(rows) == expected, (len(rows), expected)
    disordered = {k: s for k, s in seqs.items() if s != list(range(1, per_key[k] + 1))}
    assert not disordered, (
        f"{len(disordered)} keys' effects out of commit order, e.g. "
        + "; ".join(f"{k}: {s[:12]}" for k, s in list(disordered.items())[:3])
    )
    split = {k: sorted(p) for k, p in partition_of.items() if len(p) > 1}
    assert not split, f"keys handled from several partitions: {list(split.items())[:5]}"
    turns: dict[int, list[int]] = defaultdict(list)
    spans: dict[int, list[list[float]]] = defaultdict(list)  # [first start, last write] a turn
    for _, _, _, _, pid, partition, _, started, at in rows:
        if turns[partition] and turns[partition][-1] == pid:
            spans[partition][-1][1] = at
        else:
            turns[partition].append(pid)
            spans[partition].append([started, at])
    handovers: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for partition, runs in spans.items():
        for before, after in itertools.pairwise(runs):
            handovers[partition].append((before[1], after[0]))
            assert before[1] <= after[0], (
                f"partition {partition}: pid {turns[partition]} handled it at the same time "
                f"(a turn's last effect at {before[1]:.3f}, the next turn began at {after[0]:.3f})"
            )
    return Effects(
        total=len(rows),
        redelivered=sum(1 for row in rows if row[6]),
        turns=dict(turns),
        handovers=dict(handovers),
    )


def _held_slots(connection: Any, channel: Any, name: str, partitions: int) -> tuple[int, Any]:
    """How many member slots (exclusive queues ``NAME.member.<slot>``) are held: a passive
    declare answers 405 (another connection's) or 404 (free), and closes the channel."""
    held = 0
    for slot in range(partitions):
        try:
            channel.queue_declare(f"{name}.member.{slot}", passive=True)
            held += 1
        except pika.exceptions.ChannelClosedByBroker as exc:
            channel = connection.channel()
            held += exc.reply_code == 405
    return held, channel
