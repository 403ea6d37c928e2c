"""`reliable-amqp worker`, run as a subprocess against the broker (issue 48).

A handler module (``worker_handlers.py``, beside this file) records each message it handled;
the worker runs it in one process or several (``--processes``), serves its health over HTTP,
restarts a child killed -9, stops gracefully on SIGTERM and gives up loudly on a crash loop.
Every wait is on a condition with a deadline (the record, the health endpoint, a queue count,
the process's exit).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.fixtures import ProxyFactory
from reliable_amqp import Consumer
from reliable_amqp._consume._options import DEFAULT_REDELIVERY
from support.broker import BrokerAdmin
from support.cli import run_cli
from support.consumer import delete_queues, drain_all, fill, ready_count, wait_until

pytestmark = pytest.mark.broker

HERE = Path(__file__).parent
#: a short redelivery policy: few delay queues, quick retries
QUICK = ("--max-attempts", "3", "--redelivery-delay", "0.1", "--redelivery-max-delay", "0.2")
QUICK_POLICY = replace(DEFAULT_REDELIVERY, max_attempts=3, initial_delay=0.1, max_delay=0.2)


class Worker:
    """One ``reliable-amqp worker`` process (run from tests/cli, where its handlers are)."""

    def __init__(self, tmp: Path, url: str, args: tuple[str, ...], env: dict[str, str]) -> None:
        self.out = tmp / "handled.txt"
        self.out.touch()
        self.err_path = tmp / "worker.stderr"
        environ = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_AMQP_")}
        environ.update(AMQP_URL=url, WORKER_TEST_OUT=str(self.out), **env)
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "reliable_amqp", "worker", *args],
                cwd=HERE,
                env=environ,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def handled(self) -> list[tuple[int, str]]:
        """(pid, message id) of every message handled, in order."""
        rows = [line.split(" ") for line in self.out.read_text().splitlines()]
        return [(int(pid), message_id) for pid, message_id in rows]

    def wait_handled(self, predicate: Callable[[list[tuple[int, str]]], bool], what: str) -> None:
        self._wait(lambda: predicate(self.handled()), 90, what)

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the worker exited ({self.proc.returncode}) before {what}:\n"
                    f"{self.stderr()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n"
                                     f"{self.stderr()[-4000:]}")  # fmt: skip
            time.sleep(0.05)

    @functools.cached_property
    def health_port(self) -> int:
        found: list[int] = []

        def logged() -> bool:
            match = re.search(r"health on http://[\d.]+:(\d+)/healthz", self.stderr())
            if match:
                found.append(int(match[1]))
            return bool(found)

        self._wait(logged, 60, "the health endpoint's log line")
        return found[0]

    def get(self, path: str = "/healthz") -> tuple[int, dict[str, Any]]:
        url = f"http://127.0.0.1:{self.health_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def wait_health(
        self,
        status: int,
        predicate: Callable[[dict[str, Any]], bool] = lambda _: True,
        timeout: float = 60,
        what: str = "",
    ) -> dict[str, Any]:
        """Poll /healthz and /readyz until both answer ``status`` with a body ``predicate``
        accepts; that body."""
        seen: list[dict[str, Any]] = []

        def answered() -> bool:
            live, body = self.get("/healthz")
            ready, _ = self.get("/readyz")
            seen[:] = [body]
            return live == status and ready == status and predicate(body)

        self._wait(answered, timeout, f"health {status} {what}: last {seen}")
        return seen[0]

    def terminate(self, timeout: float = 90) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def worker(tmp_path: Path, amqp_url: str) -> Iterator[Callable[..., Worker]]:
    """``worker(*args, url=..., env=...)`` starts a worker; killed after the test if still
    running, its consumer's own queues (dead letters, delay queues) deleted."""
    made: list[tuple[Worker, str | None]] = []

    def start(*args: str, url: str = amqp_url, env: dict[str, str] | None = None) -> Worker:
        place = tmp_path / f"worker{len(made)}"
        place.mkdir()
        started = Worker(place, url, args, env or {})
        queue = args[args.index("--queue") + 1] if "--queue" in args else None
        made.append((started, queue))
        return started

    yield start
    for started, queue in made:
        started.close()
        if queue is not None:
            # every worker here runs with QUICK (or fewer attempts: a subset of its queues)
            own = Consumer(amqp_url, queue, redelivery=QUICK_POLICY).own_queues
            delete_queues(amqp_url, own)


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def test_processes_restart_a_child_killed_9_and_the_work_goes_on(
    worker: Callable[..., Worker], broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    w = worker(
        "worker_handlers:handle", "--queue", queue, "--processes", "2", "--health-port", "0",
        "--prefetch", "10", *QUICK, env={"WORKER_TEST_SLEEP": "0.005"},
    )  # fmt: skip
    health = w.wait_health(200, what="both children consuming")
    pids = [p["pid"] for p in health["processes"]]
    assert len(set(pids)) == 2 and all(p["health"]["subscribed"] for p in health["processes"])
    first = _ids("a", 300)
    fill(amqp_url, queue, first)
    w.wait_handled(lambda rows: len(rows) >= 50, "50 messages handled")
    os.kill(pids[0], signal.SIGKILL)
    health = w.wait_health(
        200,
        lambda h: h["processes"][0]["pid"] not in pids and h["processes"][0]["restarts"] == 1,
        what="process 0 restarted with a new pid",
    )
    new_pid = health["processes"][0]["pid"]
    assert health["processes"][1]["pid"] == pids[1]  # the other one was left alone
    w.wait_handled(lambda rows: set(first) <= {m for _, m in rows}, "every message handled")
    second = _ids("b", 100)
    fill(amqp_url, queue, second)
    w.wait_handled(lambda rows: set(second) <= {m for _, m in rows}, "the second batch")
    assert new_pid in {pid for pid, m in w.handled() if m.startswith("b")}  # it works too
    wait_until(lambda: ready_count(amqp_url, queue) == 0, 30, "the queue empty")
    assert w.terminate() == 0, w.stderr()[-4000:]
    err = w.stderr()
    assert f"(pid {pids[0]}) was killed by SIGKILL; starting it again in 1 s" in err, err
    assert "every process stopped gracefully" in err
    # a kill -9 gives back what the child held unacked: a duplicate or a few, never a loss
    counts = Counter(m for _, m in w.handled())
    assert set(counts) == set(first) | set(second)
    assert sum(counts.values()) - len(counts) <= 10  # at most the killed child's prefetch
    assert ready_count(amqp_url, queue) == 0


def test_the_processes_stop_when_the_worker_is_killed_9(
    worker: Callable[..., Worker], broker: BrokerAdmin, amqp_url: str
) -> None:
    """No orphan goes on consuming unsupervised: a child whose parent is gone stops within a
    report interval (its health pipe breaks), gracefully."""
    queue = broker.queue()
    w = worker(
        "worker_handlers:handle", "--queue", queue, "--processes", "2", "--health-port", "0",
        *QUICK,
    )  # fmt: skip
    pids = [p["pid"] for p in w.wait_health(200, what="consuming")["processes"]]
    w.proc.kill()
    w.proc.wait(30)

    def gone(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        return state == "Z"  # exited, not reaped yet by whoever inherited it

    wait_until(lambda: all(gone(pid) for pid in pids), 30, "the orphaned processes to stop")
    assert w.stderr().count("the supervising process is gone; stopping") == 2, w.stderr()
    fill(amqp_url, queue, ["after"])
    assert ready_count(amqp_url, queue) == 1  # nobody consumes any more


@pytest.mark.parametrize("mode", ["processes", "async"])
def test_health_is_503_while_the_broker_is_unreachable(
    mode: str,
    worker: Callable[..., Worker],
    broker: BrokerAdmin,
    make_proxy: ProxyFactory,
    amqp_url: str,
) -> None:
    queue = broker.queue()
    proxy = make_proxy()
    how = ("--processes", "2") if mode == "processes" else ("--async", "--concurrency", "4")
    target = "worker_handlers:handle" if mode == "processes" else "worker_handlers:handle_async"
    w = worker(target, "--queue", queue, *how, "--health-port", "0", *QUICK, url=proxy.url())
    w.wait_health(200, what="consuming")
    fill(amqp_url, queue, _ids("a", 20))
    w.wait_handled(lambda rows: len({m for _, m in rows}) == 20, "20 handled")

    proxy.refuse()  # the broker is unreachable: connections cut, new ones reset
    proxy.cut()
    body = w.wait_health(503, what="the broker unreachable")
    states = [p["health"] for p in body["processes"]] if mode == "processes" else [body]
    assert any(not s["connected"] or not s["subscribed"] for s in states if s), body
    assert not body["healthy"]

    proxy.accept()
    w.wait_health(200, timeout=90, what="reconnected")
    fill(amqp_url, queue, _ids("b", 20))
    w.wait_handled(lambda rows: len({m for _, m in rows}) == 40, "20 more handled")
    assert w.terminate() == 0, w.stderr()[-4000:]


@pytest.mark.parametrize("mode", ["processes", "async"])
def test_sigterm_stops_gracefully_with_nothing_lost(
    mode: str, worker: Callable[..., Worker], broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    how = ("--processes", "2") if mode == "processes" else ("--async", "--concurrency", "4")
    target = "worker_handlers:handle" if mode == "processes" else "worker_handlers:handle_async"
    ids = _ids("m", 400)
    fill(amqp_url, queue, ids)
    w = worker(
        target, "--queue", queue, *how, "--prefetch", "20", *QUICK,
        env={"WORKER_TEST_SLEEP": "0.02"},
    )  # fmt: skip
    w.wait_handled(lambda rows: len(rows) >= 60, "60 messages handled")
    assert w.terminate() == 0, w.stderr()[-4000:]
    handled = Counter(m for _, m in w.handled())
    assert max(handled.values()) == 1, "handled twice: " + str(handled.most_common(3))
    left = [props.message_id for props, _ in drain_all(amqp_url, queue)]
    assert len(left) == len(set(left))
    assert not set(left) & set(handled), "handled and still in the queue (unacked)"
    assert set(left) | set(handled) == set(ids), "lost"
    assert 60 <= len(handled) < len(ids)
    if mode == "processes":
        assert "every process stopped gracefully" in w.stderr()


@pytest.mark.parametrize(
    ("target", "flags", "said"),
    [
        ("worker_handlers:handle_async", (), "is a coroutine function (async def): run it "
         "with --async"),
        ("worker_handlers:handle_async", ("--processes", "2"), "run it with --async"),
        ("worker_handlers:partial_coroutine", (), "is a coroutine function"),
        ("worker_handlers:async_callable", (), "is a coroutine function"),
        ("worker_handlers:handle", ("--async",), "is a plain function, not a coroutine "
         "function (async def): run it without --async"),
        ("worker_handlers:generator", (), "is a generator function"),
        ("worker_handlers:generator", ("--async",), "is a generator function"),
        ("worker_handlers:handle", ("--concurrency", "4"), "--concurrency above 1 needs --async"),
        ("no_such_module_here:handle", (), "cannot import 'no_such_module_here': no module "
         "named 'no_such_module_here'"),
        ("worker_handlers:missing", (), "module 'worker_handlers' has no attribute 'missing'"),
        ("worker_handlers:NOT_CALLABLE", (), "worker_handlers:NOT_CALLABLE is an int, not a "
         "function"),
        ("worker_handlers", (), "expected MODULE:HANDLER"),
    ],
)  # fmt: skip
def test_a_handler_of_the_wrong_kind_or_a_bad_target_is_refused_before_consuming(
    target: str, flags: tuple[str, ...], said: str, broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    fill(amqp_url, queue, ["untouched"])
    env = {"WORKER_TEST_OUT": os.devnull}
    result = subprocess.run(
        [sys.executable, "-m", "reliable_amqp", "worker", target, "--queue", queue, *flags],
        cwd=HERE,
        env={**os.environ, "AMQP_URL": amqp_url, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("reliable-amqp worker: error: "), result.stderr
    assert said in last, last
    assert ready_count(amqp_url, queue) == 1  # nothing was consumed
    assert "Traceback" not in result.stderr


def test_a_crash_looping_worker_gives_up_loudly(
    worker: Callable[..., Worker], broker: BrokerAdmin, amqp_url: str
) -> None:
    queue = broker.queue()
    ids = _ids("m", 10)
    fill(amqp_url, queue, ids)
    w = worker("worker_handlers:crash", "--queue", queue, "--processes", "2", *QUICK)
    code = w.proc.wait(120)
    err = w.stderr()
    assert code == 1, err[-4000:]
    gave_up = [line for line in err.splitlines() if "giving up" in line]
    assert len(gave_up) == 1, err[-4000:]
    assert " ERROR " in gave_up[0]
    assert "worker processes died 5 times within 60 s" in gave_up[0]
    assert "exited with status 17" in gave_up[0]
    assert err.count("starting it again in") == 4
    # every message is back in the queue: the crashes held them unacked
    wait_until(lambda: ready_count(amqp_url, queue) == len(ids), 30, "every message back")


def test_attempts_db_dead_letters_a_message_that_kills_the_process_every_time(
    worker: Callable[..., Worker], broker: BrokerAdmin, amqp_url: str, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'inbox.db'}"
    assert run_cli("inbox", "init", "--db", db, url=None).returncode == 0
    queue = broker.queue()  # a classic queue: the broker only says "redelivered"
    ids = _ids("m", 5)
    fill(amqp_url, queue, ["poison", *ids])
    w = worker(
        "worker_handlers:crash_on_poison", "--queue", queue, "--processes", "1", *QUICK,
        "--max-attempts", "2", "--attempts-db", db, "--prefetch", "1",
    )  # fmt: skip
    dead = f"{queue}.dead"
    w.wait_handled(lambda rows: {m for _, m in rows} == set(ids), "the others handled")
    w._wait(lambda: ready_count(amqp_url, dead) == 1, 60, "the poison dead-lettered")
    assert w.terminate() == 0, w.stderr()[-4000:]
    (props, _), *more = drain_all(amqp_url, dead)
    assert not more and props.message_id == "poison"
    assert props.headers["x-exception-type"] == "AttemptsExceeded", props.headers
    assert w.stderr().count("exited with status 17; starting it again") == 2


def test_processes_share_the_partitions_of_a_group(
    worker: Callable[..., Worker], amqp_url: str
) -> None:
    """--partitions 4 --processes 2: the two children are members of one group, 2 and 2."""
    import pika

    from reliable_amqp import Publisher
    from reliable_amqp._core.partitions import (
        config_queue,
        partition_queues,
    )

    name = f"ra-test-worker-part-{os.getpid()}-{time.monotonic_ns()}"
    w = worker(
        "worker_handlers:handle", "--queue", name, "--partitions", "4", "--declare",
        "--key", "routing_key", "--processes", "2", "--health-port", "0", *QUICK,
    )  # fmt: skip
    try:
        w.wait_health(
            200,
            lambda body: (
                sorted(len(p["health"]["partitions"] or ()) for p in body["processes"]) == [2, 2]
            ),
            what="both children in the group, 2 partitions each",
        )
        ids = _ids("p", 200)
        with Publisher(amqp_url) as publisher:
            for i, message_id in enumerate(ids):
                publisher.publish(name, f"key-{i % 20}", b"x", message_id=message_id)
            assert publisher.flush(30) == 0
        w.wait_handled(lambda rows: len(rows) >= len(ids), "every message handled")
        assert sorted(m for _, m in w.handled()) == ids  # each once
        assert len({pid for pid, _ in w.handled()}) == 2  # both members had partitions
        assert w.terminate() == 0, w.stderr()[-4000:]
        assert "takes partition" in w.stderr()
    finally:
        w.close()
        own = Consumer(amqp_url, name, partitions=4, redelivery=QUICK_POLICY).own_queues
        group = [config_queue(name)]  # (its slots and locks are exclusive: gone already)
        delete_queues(amqp_url, [*partition_queues(name, 4), *own, *group])
        connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
        connection.channel().exchange_delete(name)
        connection.close()
