"""``support.spark.start_query``: starts a streaming query again only when Spark's driver could not
start its Python worker in time, and never hides anything else."""

from __future__ import annotations

import pytest

from support.spark import START_ATTEMPTS, WORKER_DID_NOT_CONNECT_BACK, start_query


class _Starts:
    """A ``start`` callable that fails with ``errors`` in turn, then returns ``"query"``."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "query"


def _late() -> Exception:
    return RuntimeError(f"{WORKER_DID_NOT_CONNECT_BACK}.\n\nJVM stacktrace: ...")


def test_a_worker_that_did_not_connect_back_is_started_again() -> None:
    start = _Starts(_late(), _late())
    assert start_query(start) == "query"
    assert start.calls == 3


def test_the_last_attempt_s_error_goes_on_up() -> None:
    start = _Starts(*(_late() for _ in range(START_ATTEMPTS)))
    with pytest.raises(RuntimeError, match=WORKER_DID_NOT_CONNECT_BACK):
        start_query(start)
    assert start.calls == START_ATTEMPTS


def test_any_other_error_is_not_retried() -> None:
    start = _Starts(ValueError("checkpoint location is not empty"))
    with pytest.raises(ValueError, match="checkpoint"):
        start_query(start)
    assert start.calls == 1
