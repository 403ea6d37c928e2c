"""Wait until the local broker is idle, so that every benchmark row starts from the same state.

A row that deletes its queue of 20,000 persistent messages leaves the broker busy for a while
(the message store cleans up on its own schedule): the next row would share the broker's cores
with that backlog, which is what made the first rows of a pass slower than the same loop run
alone. Before each row the benchmark waits until the broker's Erlang VM (``beam.smp``, found
through psutil) has used under ``threshold`` of one core for ``window`` seconds. On a broker that
is not on this machine there is nothing to watch: it waits ``fallback`` seconds instead.
"""

from __future__ import annotations

import os
import time

import psutil


def broker_pids() -> list[int]:
    """The pids of local Erlang VMs (RabbitMQ's ``beam.smp``)."""
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "beam.smp"]


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:  # gone since (a node stopped)
            continue
        total += times.user + times.system
    return total


#: how long a row waits for an idle broker at most (the test that runs every row briefly sets
#: it low: there the rows' figures do not matter, only that each one runs)
IDLE_TIMEOUT = float(os.environ.get("RELIABLE_AMQP_BENCH_IDLE_TIMEOUT", "30"))


def wait_idle(
    threshold: float = 0.05,
    window: float = 0.5,
    timeout: float | None = None,
    fallback: float = 1.0,
) -> float:
    """Block until the broker is idle (see the module docstring); returns the seconds waited."""
    timeout = IDLE_TIMEOUT if timeout is None else timeout
    started = time.monotonic()
    pids = broker_pids()
    if not pids:
        time.sleep(fallback)
        return fallback
    while time.monotonic() - started < timeout:
        before = _cpu_seconds(pids)
        time.sleep(window)
        if (_cpu_seconds(pids) - before) / window < threshold:
            break
    return time.monotonic() - started


if __name__ == "__main__":
    print(f"beam.smp pids: {broker_pids()}; idle after {wait_idle():.2f} s")
