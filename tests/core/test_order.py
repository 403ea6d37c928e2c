"""The per-key fence (reliable_amqp._core.order) against a model of the broker's queues.

The model: the consumed queue and each delay queue are FIFO; a delay queue gives its head back
to the consumed queue's tail at any moment (any interleaving between delay queues, a superset of
what TTLs allow); new messages arrive at any moment. A consumer following the fence's answers
must handle each key's messages in publish order, each once, whatever fails and when.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, ClassVar

import pytest

from reliable_amqp import ConfigurationError
from reliable_amqp._core.order import HEAD_HEADER, PARKED_HEADER, Fences, key_reader, parked_seq

MAX_ATTEMPTS = 4


def simulate(seed: int, hold: bool = False) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    rng = random.Random(seed)
    keys = ["a", "b", "c"][: rng.randint(1, 3)]
    per_key = rng.randint(1, 25)
    fail_rate = rng.choice([0.0, 0.1, 0.3, 0.6])
    pending = deque((key, n) for n in range(per_key) for key in keys)
    main: deque[dict[str, Any]] = deque()
    delays: dict[str, deque[dict[str, Any]]] = {f"d{a}": deque() for a in range(1, MAX_ATTEMPTS)}
    fences = Fences("hold" if hold else "continue")
    handled: list[tuple[str, int]] = []
    dead: list[tuple[str, int]] = []
    for _ in range(100_000):
        sources = [name for name, q in delays.items() if q]
        choices = (["arrive"] if pending else []) + (["deliver"] if main else []) + sources
        if not choices:
            break
        pick = rng.choice(choices)
        if pick == "arrive":
            key, n = pending.popleft()
            main.append({"key": key, "n": n, "attempt": 1, "headers": {}})
            continue
        if pick != "deliver":
            main.append(delays[pick].popleft())
            continue
        m = main.popleft()
        key = m["key"]
        admitted = fences.admit(key, m["headers"], f"{key}/{m['n']}")
        if admitted is not None:
            queue, seq = admitted
            headers = {k: v for k, v in m["headers"].items() if k != HEAD_HEADER}
            headers[PARKED_HEADER] = seq
            delays[queue].append({**m, "headers": headers})
            continue
        was_parked = parked_seq(m["headers"])
        if m["attempt"] < MAX_ATTEMPTS and rng.random() < fail_rate:
            token = fences.retrying(key, "d1", was_parked)
            headers = {HEAD_HEADER: token}
            delays[f"d{m['attempt']}"].append(
                {**m, "attempt": m["attempt"] + 1, "headers": headers}
            )
        elif m["attempt"] >= MAX_ATTEMPTS and rng.random() < fail_rate:
            fences.dead(key, "d1", was_parked, f"{key}/{m['n']}")
            dead.append((key, m["n"]))
            if hold:  # an operator requeues it at once (dead-letters --requeue)
                main.append({**m, "attempt": 1, "headers": {}})
        else:
            fences.settled(key, was_parked)
            handled.append((key, m["n"]))
    else:
        raise AssertionError("the model did not settle")
    return handled, dead


@pytest.mark.parametrize("seed", range(400))
def test_every_key_is_handled_in_publish_order_through_retries(seed: int) -> None:
    handled, dead = simulate(seed)
    seen: dict[str, list[int]] = {}
    for key, n in handled:
        seen.setdefault(key, []).append(n)
    for key, seq in seen.items():
        assert seq == sorted(seq), (seed, key, seq)
    assert len(handled) + len(dead) == len(set(handled) | set(dead))  # each once


@pytest.mark.parametrize("seed", range(200))
def test_hold_handles_the_dead_message_before_its_keys_later_ones(seed: int) -> None:
    handled, _dead = simulate(seed, hold=True)
    seen: dict[str, list[int]] = {}
    for key, n in handled:
        seen.setdefault(key, []).append(n)
    for key, seq in seen.items():
        assert seq == sorted(set(seq)), (seed, key, seq)


def test_key_reader_options() -> None:
    class D:
        routing_key = "rk"
        headers: ClassVar[dict[str, object]] = {"entity": b"e1", "n": 7}

    assert key_reader("routing_key")(D()) == "rk"  # type: ignore[misc]
    assert key_reader("header:entity")(D()) == "e1"  # type: ignore[misc]
    assert key_reader("header:n")(D()) == "7"  # type: ignore[misc]
    assert key_reader("header:missing")(D()) is None  # type: ignore[misc]
    assert key_reader(None) is None
    with pytest.raises(ConfigurationError):
        key_reader("queue")
    reader = key_reader(lambda d: 5)
    assert reader is not None
    with pytest.raises(TypeError, match="not a str"):
        reader(D())
