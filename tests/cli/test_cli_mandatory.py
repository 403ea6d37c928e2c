"""The command line publishes mandatory by default, as the library does: a message no queue
takes fails as returned (exit 1); ``--no-mandatory`` lets the broker confirm and drop it."""

from __future__ import annotations

import json

import pytest

from support.broker import BrokerAdmin
from support.cli import run_cli

pytestmark = pytest.mark.broker


def test_unroutable_lines_fail_by_default_and_not_with_no_mandatory(
    amqp_url: str, broker: BrokerAdmin
) -> None:
    exchange = broker.exchange()  # bound to nothing
    route = ("--exchange", exchange, "--routing-key", "nowhere")
    default = run_cli("publish", *route, url=amqp_url, stdin=b"a\nb\n")
    assert default.returncode == 1, default.stderr
    assert "line 1: returned" in default.stderr and "line 2: returned" in default.stderr
    dropped = run_cli("publish", *route, "--no-mandatory", url=amqp_url, stdin=b"a\nb\n")
    assert dropped.returncode == 0, dropped.stderr


def test_a_jsonl_line_may_opt_out_alone(amqp_url: str, broker: BrokerAdmin) -> None:
    exchange = broker.exchange()
    lines = [
        {"body": "kept?", "exchange": exchange, "routing_key": "nowhere"},
        {"body": "dropped", "exchange": exchange, "routing_key": "nowhere", "mandatory": False},
    ]
    stdin = "".join(json.dumps(line) + "\n" for line in lines).encode()
    result = run_cli("publish", "--format", "jsonl", url=amqp_url, stdin=stdin)
    assert result.returncode == 1, result.stderr
    assert "line 1: returned" in result.stderr
    assert "line 2" not in result.stderr
