"""Unit tests of ``_core/policy.py``: RetryPolicy delays, limits, from_dict and tenacity."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from reliable_amqp._core.errors import (
    AmqpConnectionError,
    AuthenticationFailed,
    ConfigurationError,
    broker_error,
)
from reliable_amqp._core.policy import RetryPolicy

# --- RetryPolicy ----------------------------------------------------------------------------------


def test_delays_grow_and_cap_at_max_delay() -> None:
    policy = RetryPolicy(initial_delay=0.1, multiplier=2.0, max_delay=1.0, jitter=0.0)
    delays = [policy.base_delay(n) for n in range(1, 8)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert policy.base_delay(0) == policy.base_delay(1)
    assert policy.base_delay(100_000) == 1.0  # no OverflowError after many failures
    assert policy.delay(3, rng=lambda: 0.99) == pytest.approx(0.4)


def test_jitter_adds_up_to_jitter_seconds() -> None:
    policy = RetryPolicy(initial_delay=1.0, jitter=0.5, max_delay=10.0)
    assert policy.delay(1, rng=lambda: 0.0) == 1.0
    assert policy.delay(1, rng=lambda: 1.0) == 1.5
    assert 1.0 <= policy.delay(1) <= 1.5


def test_step_adds_linear_growth() -> None:
    policy = RetryPolicy(initial_delay=1.0, multiplier=1.0, step=0.5, max_delay=2.2, jitter=0)
    assert [policy.base_delay(n) for n in range(1, 6)] == [1.0, 1.5, 2.0, 2.2, 2.2]


def test_zero_initial_delay_stays_zero_after_many_failures() -> None:
    policy = RetryPolicy(max_attempts=None, initial_delay=0.0, max_delay=5.0, jitter=0.0)
    assert policy.base_delay(1000) == 0.0
    assert policy.base_delay(2000) == 0.0


def test_allows_stops_at_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert [policy.allows(n) for n in range(5)] == [True, True, True, False, False]
    unlimited = RetryPolicy(max_attempts=None)
    assert unlimited.allows(10**9, elapsed=10**9)


def test_allows_stops_when_the_next_attempt_would_start_after_the_deadline() -> None:
    policy = RetryPolicy(max_attempts=None, initial_delay=1.0, jitter=0.0, deadline=10.0)
    assert policy.allows(1, elapsed=9.0)
    assert not policy.allows(1, elapsed=9.5)
    assert not policy.allows(1, elapsed=20.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"initial_delay": -0.1},
        {"max_delay": float("inf")},
        {"jitter": float("nan")},
        {"step": -1.0},
        {"multiplier": 0.5},
        {"multiplier": float("nan")},
        {"deadline": 0},
        {"deadline": -5.0},
    ],
)
def test_invalid_policies_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(kwargs))):
        RetryPolicy(**kwargs)


def test_from_dict_accepts_its_own_fields_and_round_trips() -> None:
    policy = RetryPolicy(max_attempts=7, initial_delay=0.3, max_delay=4.0, multiplier=3.0,
                         step=0.1, jitter=0.0, deadline=30.0)  # fmt: skip
    assert RetryPolicy.from_dict(policy.to_dict()) == policy
    assert RetryPolicy.from_dict(policy) is policy
    assert RetryPolicy.from_dict(None) == RetryPolicy()
    assert RetryPolicy.from_dict({}) == RetryPolicy()
    assert RetryPolicy.from_dict({"max_attempts": None}).max_attempts is None


def test_from_dict_fills_missing_fields_from_base() -> None:
    base = RetryPolicy(max_attempts=9, initial_delay=0.7, jitter=0.0, deadline=50.0)
    assert RetryPolicy.from_dict(None, base=base) is base
    assert RetryPolicy.from_dict({"deadline": "30"}, base=base) == dataclasses.replace(
        base, deadline=30.0
    )
    assert RetryPolicy.from_dict({"interval_max": 3}, base=base) == dataclasses.replace(
        base, max_delay=3.0, multiplier=1.0
    )


def test_from_dict_accepts_kombu_keys_with_linear_growth() -> None:
    policy = RetryPolicy.from_dict(
        {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
    )
    assert policy.max_attempts == 4  # kombu counts retries, the policy counts attempts
    assert (policy.multiplier, policy.jitter) == (1.0, 0.0)
    assert [policy.delay(n) for n in range(1, 6)] == pytest.approx([0.0, 0.2, 0.4, 0.5, 0.5])
    assert [policy.allows(n) for n in range(3, 6)] == [True, False, False]


def test_from_dict_accepts_string_values() -> None:
    policy = RetryPolicy.from_dict(
        {"max_attempts": " 3 ", "initial_delay": "0.5", "max_delay": "8", "deadline": "none"}
    )
    assert (policy.max_attempts, policy.initial_delay, policy.max_delay) == (3, 0.5, 8.0)
    assert policy.deadline is None
    assert RetryPolicy.from_dict({"deadline": "12.5"}).deadline == 12.5
    assert RetryPolicy.from_dict({"max_attempts": ""}).max_attempts is None
    kombu = RetryPolicy.from_dict({"max_retries": "2", "interval_start": "1", "interval_step": "1"})
    assert (kombu.max_attempts, kombu.base_delay(2)) == (3, 2.0)
    assert RetryPolicy.from_dict({"max_retries": "none"}).max_attempts is None


@pytest.mark.parametrize(
    "config, named",
    [
        ({"retries": 3}, "retries"),
        ({"max_attempts": 3, "backoff": 2}, "backoff"),
        ({"max_attempts": "three"}, "max_attempts"),
        ({"max_attempts": 2.5}, "max_attempts"),
        ({"max_attempts": "2.5"}, "max_attempts"),
        ({"max_attempts": "0"}, "max_attempts"),
        ({"initial_delay": "soon"}, "initial_delay"),
        ({"initial_delay": True}, "initial_delay"),
        ({"multiplier": "0.5"}, "multiplier"),
        ({"jitter": "nan"}, "jitter"),
        ({"deadline": "-1"}, "deadline"),
        ({"max_retries": "x"}, "max_retries"),
        ({"max_retries": -1}, "max_attempts"),
        ({"interval_start": [1]}, "interval_start"),
    ],
)
def test_from_dict_rejects_unknown_keys_and_bad_values(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        RetryPolicy.from_dict(config)


@pytest.mark.parametrize("config", ["max_attempts=3", 3, ["max_attempts"]])
def test_from_dict_rejects_non_mappings(config: Any) -> None:
    with pytest.raises(ConfigurationError, match="mapping"):
        RetryPolicy.from_dict(config)


_FAST = RetryPolicy(max_attempts=5, initial_delay=0, jitter=0)


def _failing(times: int, error: BaseException) -> Any:
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    call.calls = calls  # type: ignore[attr-defined]
    return call


@pytest.mark.parametrize(
    "error",
    [AmqpConnectionError("lost"), broker_error(320, "CONNECTION_FORCED"), broker_error(541, "")],
)
def test_retrying_retries_retriable_errors(error: BaseException) -> None:
    call = _failing(2, error)
    assert _FAST.retrying()(call) == "done"
    assert len(call.calls) == 3


@pytest.mark.parametrize(
    "error",
    [
        ConfigurationError("bad"),
        AuthenticationFailed("no"),
        broker_error(404, "NOT_FOUND"),
        ValueError("not ours"),
    ],
)
def test_retrying_does_not_retry_other_errors(error: BaseException) -> None:
    call = _failing(1, error)
    with pytest.raises(type(error)) as info:
        _FAST.retrying()(call)
    assert info.value is error
    assert len(call.calls) == 1


def test_retrying_stops_at_max_attempts_and_reraises_the_error() -> None:
    error = AmqpConnectionError("down")
    call = _failing(100, error)
    with pytest.raises(AmqpConnectionError) as info:
        RetryPolicy(max_attempts=3, initial_delay=0, jitter=0).retrying()(call)
    assert info.value is error
    assert len(call.calls) == 3


def test_retrying_waits_as_the_policy_says() -> None:
    slept: list[float] = []
    policy = RetryPolicy(max_attempts=4, initial_delay=0.1, multiplier=3.0, jitter=0)
    call = _failing(3, AmqpConnectionError("x"))
    assert policy.retrying(sleep=slept.append)(call) == "done"
    assert slept == pytest.approx([0.1, 0.3, 0.9])
