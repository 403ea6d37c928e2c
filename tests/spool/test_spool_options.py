"""The spool options: checked, given as strings, and what they change about the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliable_amqp import ConfigurationError, PublisherOptions
from reliable_amqp._core.options import (
    DEFAULT_CONNECT_POLICY,
    SPOOL_CONNECT_POLICY,
    SPOOL_DELIVERY_TIMEOUT,
)
from support.broker import AMQP_DEFAULT_PORT

URL = f"amqp://guest:guest@127.0.0.1:{AMQP_DEFAULT_PORT}/%2F"


def test_a_spool_waits_as_long_as_it_takes_unless_told_otherwise(tmp_path: Path) -> None:
    options = PublisherOptions.create(URL, spool=tmp_path)  # a PathLike is taken
    assert options.spool == str(tmp_path)
    assert options.delivery_timeout == SPOOL_DELIVERY_TIMEOUT
    assert options.connect_policy == SPOOL_CONNECT_POLICY
    assert SPOOL_CONNECT_POLICY.max_attempts is None and SPOOL_CONNECT_POLICY.deadline is None
    given = PublisherOptions.create(
        URL, spool=str(tmp_path), delivery_timeout=5.0, connect_policy={"max_attempts": 3}
    )
    assert given.delivery_timeout == 5.0
    assert given.connect_policy.max_attempts == 3
    plain = PublisherOptions.create(URL)
    assert plain.connect_policy == DEFAULT_CONNECT_POLICY and plain.delivery_timeout == 120.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"spool": ""}, "spool must be a directory path"),
        ({"spool": 5}, "spool must be a directory path"),
        ({"spool_max_bytes": 0}, "spool_max_bytes must be a whole number >= 1"),
        ({"spool_fsync": "always"}, "spool_fsync must be one of commit, persist, never"),
    ],
)
def test_bad_spool_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PublisherOptions.create(URL, **options)


def test_spool_options_as_strings(tmp_path: Path) -> None:
    options = PublisherOptions.from_strings(
        URL, {"spool": str(tmp_path), "spool_max_bytes": "1000", "spool_fsync": "commit"}
    )
    assert (options.spool, options.spool_max_bytes, options.spool_fsync) == (
        str(tmp_path),
        1000,
        "commit",
    )
    assert PublisherOptions.from_strings(URL, {"spool": ""}).spool is None
