"""`reliable-amqp publish` run as a subprocess against the real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from support.broker import BrokerAdmin, unique
from support.cli import run_cli

pytestmark = pytest.mark.broker


def bodies(broker: BrokerAdmin, queue: str) -> list[bytes]:
    return [body for _, body in broker.drain(queue)]


def test_plain_lines_from_a_file(amqp_url: str, broker: BrokerAdmin, tmp_path: Path) -> None:
    queue = broker.queue()
    source = tmp_path / "in.txt"
    source.write_bytes(b"first\nsecond\r\n\nthird")  # CRLF, an empty line, no final newline
    result = run_cli("publish", str(source), "--routing-key", queue, url=amqp_url)
    assert result.returncode == 0, result.stderr
    assert bodies(broker, queue) == [b"first", b"second", b"third"]
    assert "confirmed" in result.stdout and "3 messages" in result.stdout
    assert result.stderr == ""  # no progress bar when stderr is not a terminal


def test_declare_queue_gives_the_routing_key(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = unique("declared")
    broker._queues.append(queue)  # deleted at teardown
    result = run_cli("publish", "--declare-queue", queue, url=amqp_url, stdin=b"a\nb\n")
    assert result.returncode == 0, result.stderr
    props = [p for p, _ in broker.drain(queue)]
    assert len(props) == 2
    assert all(p.delivery_mode == 2 for p in props)  # persistent by default
    assert len({p.message_id for p in props}) == 2


def test_json_lines_with_properties_and_headers(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    exchange = broker.exchange(kind="topic")
    broker.bind(queue, exchange, "orders.#")
    lines = [
        {"body": "plain", "routing_key": queue, "exchange": ""},
        {
            "body": "aGVsbG8gd29ybGQ=",
            "body_encoding": "base64",
            "exchange": exchange,
            "routing_key": "orders.eu",
            "headers": {"tenant": "acme", "n": 3, "tags": ["a", "b"]},
            "message_id": "order-42",
            "content_type": "text/plain",
            "priority": 5,
            "correlation_id": "c-1",
            "timestamp": "2024-05-01T12:00:00+00:00",
            "delivery_mode": 1,
        },
        {"body": "", "routing_key": queue},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n", encoding="utf-8")
    result = run_cli("publish", "--format", "jsonl", str(source), url=amqp_url)
    assert result.returncode == 0, result.stderr
    got = broker.drain(queue)
    assert [body for _, body in got] == [b"plain", b"hello world", b""]
    props = got[1][0]
    assert props.message_id == "order-42"
    assert props.headers == {"tenant": "acme", "n": 3, "tags": ["a", "b"]}
    assert props.content_type == "text/plain"
    assert props.priority == 5
    assert props.correlation_id == "c-1"
    assert props.timestamp == 1714564800
    assert props.delivery_mode == 1


def test_stdin_with_default_headers(amqp_url: str, broker: BrokerAdmin) -> None:
    queue = broker.queue()
    stdin = b'{"body": "x", "headers": {"own": "1"}}\n{"body": "y"}\n'
    result = run_cli(
        "publish",
        "--format",
        "jsonl",
        "--routing-key",
        queue,
        "--header",
        "source=cli",
        "--content-type",
        "application/json",
        url=amqp_url,
        stdin=stdin,
    )
    assert result.returncode == 0, result.stderr
    got = broker.drain(queue)
    assert [p.headers for p, _ in got] == [{"source": "cli", "own": "1"}, {"source": "cli"}]
    assert {p.content_type for p, _ in got} == {"application/json"}
    assert "stdin" in result.stdout


def test_partially_nacked_run_then_replay(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    # A queue that holds 5 messages and nacks the rest (x-overflow=reject-publish).
    queue = broker.queue(
        **cast(dict[str, Any], {"x-max-length": 5, "x-overflow": "reject-publish"})
    )
    source = tmp_path / "in.txt"
    source.write_text("".join(f"message {i}\n" for i in range(1, 9)))
    failed = tmp_path / "failed.jsonl"
    result = run_cli(
        "publish",
        str(source),
        "--routing-key",
        queue,
        "--failed",
        str(failed),
        "--nack-retries",
        "1",
        "--retry-initial-delay",
        "0.01",
        "--retry-max-delay",
        "0.05",
        url=amqp_url,
    )
    assert result.returncode == 1, result.stderr
    assert "nacked" in result.stdout and "3" in result.stdout
    records = [json.loads(line) for line in failed.read_text().splitlines()]
    assert [r["body"] for r in records] == ["message 6", "message 7", "message 8"]
    assert [r["error"]["line"] for r in records] == [6, 7, 8]
    assert {r["error"]["type"] for r in records} == {"MessageNacked"}
    assert all(r["error"]["attempts"] == 2 for r in records)
    assert broker.count(queue) == 5

    broker.purge(queue)  # room again: the failed file replays as it is
    replay_failed = tmp_path / "failed-again.jsonl"
    replay = run_cli(
        "publish",
        "--format",
        "jsonl",
        str(failed),
        "--failed",
        str(replay_failed),
        url=amqp_url,
    )
    assert replay.returncode == 0, replay.stderr
    assert replay_failed.read_text() == ""
    got = broker.drain(queue)
    assert [body for _, body in got] == [b"message 6", b"message 7", b"message 8"]
    # the same message ids: a consumer that deduplicates sees the replay as the same messages
    assert [p.message_id for p, _ in got] == [r["message_id"] for r in records]


def test_malformed_json_names_the_line_and_publishes_nothing(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    source = tmp_path / "bad.jsonl"
    good = json.dumps({"body": "ok", "routing_key": queue})
    source.write_text(f'{good}\n{good}\n\n{good}\n{{"body": "oops",}}\n{good}\n')
    failed = tmp_path / "failed.jsonl"
    result = run_cli(
        "publish", "--format", "jsonl", str(source), "--failed", str(failed), url=amqp_url
    )
    assert result.returncode == 2
    assert "line 5" in result.stderr and "malformed JSON" in result.stderr
    assert "nothing was published" in result.stderr
    assert broker.count(queue) == 0
    assert not failed.exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"body": 7, "routing_key": "q"}', "invalid body"),
        ('["body"]', "expected a JSON object"),
        ('{"body": "x", "routing_key": "q", "colour": "red"}', "unknown field 'colour'"),
        ('{"body": "x", "routing_key": "q", "priority": 300}', "invalid priority"),
        (
            '{"body": "x", "routing_key": "q", "body_encoding": "base64"}',
            "invalid body: not valid base64",
        ),
        ('{"body": "x", "routing_key": "q", "headers": "h"}', "invalid headers"),
        ('{"body": "x", "routing_key": "q", "timestamp": "yesterday"}', "invalid timestamp"),
        ('{"body": "x", "routing_key": "' + "k" * 300 + '"}', "invalid routing_key"),
        ('{"body": "x"}', "no routing key"),
        ('{"routing_key": "q"}', "missing field 'body'"),
    ],
)
def test_bad_lines_are_reported_by_number(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path, line: str, expected: str
) -> None:
    queue = broker.queue()
    good = json.dumps({"body": "ok", "routing_key": queue})
    source = tmp_path / "bad.jsonl"
    source.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    result = run_cli("publish", "--format", "jsonl", str(source), url=amqp_url)
    assert result.returncode == 2
    assert f"line 3: {expected}" in result.stderr, result.stderr
    assert broker.count(queue) == 0


def test_every_bad_line_is_listed(amqp_url: str, tmp_path: Path) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(["{"] * 15) + "\n")
    result = run_cli(
        "publish", "--format", "jsonl", "--routing-key", "q", str(source), url=amqp_url
    )
    assert result.returncode == 2
    assert "line 1:" in result.stderr and "line 10:" in result.stderr
    assert "and 5 more bad lines" in result.stderr


def test_usage_errors_exit_2(amqp_url: str, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("x\n")
    no_key = run_cli("publish", str(source), url=amqp_url)
    assert no_key.returncode == 2 and "routing key" in no_key.stderr
    missing = run_cli("publish", str(tmp_path / "nope.txt"), "--routing-key", "q", url=amqp_url)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    bad_option = run_cli(
        "publish", str(source), "--routing-key", "q", "-o", "colour=red", url=amqp_url
    )
    assert bad_option.returncode == 2 and "colour" in bad_option.stderr
    bad_url = run_cli("publish", str(source), "--routing-key", "q", url="http://x:secret@h/")
    assert bad_url.returncode == 2 and "secret" not in bad_url.stderr


def test_unreachable_broker_exits_3_and_keeps_every_message(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\nb\n")
    failed = tmp_path / "failed.jsonl"
    result = run_cli(
        "publish",
        str(source),
        "--routing-key",
        "q",
        "--failed",
        str(failed),
        "--connect-retries",
        "0",
        "--connect-timeout",
        "2",
        url="amqp://someone:s3cret-pw@127.0.0.1:1/%2F",
    )
    assert result.returncode == 3, result.stderr
    assert "s3cret-pw" not in result.stdout + result.stderr
    # the error once, one line with the cause, no class names (the unsent are in --failed)
    assert result.stderr.splitlines() == [
        "reliable-amqp: cannot connect to amqp://someone:***@127.0.0.1:1/%2F: gave up connecting "
        "after 1 attempts: connection refused at 127.0.0.1:1"
    ]
    records = [json.loads(line) for line in failed.read_text().splitlines()]
    assert [r["body"] for r in records] == ["a", "b"]
    assert all(r["error"]["type"] == "NotPublished" for r in records)


def test_wrong_password_exits_3_without_echoing_it(amqp_url: str, tmp_path: Path) -> None:
    host = amqp_url.rpartition("@")[2]
    result = run_cli(
        "publish", "--routing-key", "q", url=f"amqp://guest:not-the-pw-9@{host}", stdin=b"x\n"
    )
    assert result.returncode == 3
    assert "not-the-pw-9" not in result.stdout + result.stderr
    assert "credentials" in result.stderr


def test_returned_and_rejected_messages_exit_1(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    exchange = broker.exchange()  # bound to nothing: mandatory messages come back
    failed = tmp_path / "failed.jsonl"
    stdin = (
        json.dumps({"body": "lost", "exchange": exchange, "routing_key": "nowhere"})
        + "\n"
        + json.dumps({"body": "gone", "exchange": unique("missing-x"), "routing_key": "k"})
        + "\n"
    ).encode()
    result = run_cli(
        "publish",
        "--format",
        "jsonl",
        "--mandatory",
        "--failed",
        str(failed),
        url=amqp_url,
        stdin=stdin,
    )
    assert result.returncode == 1, result.stderr
    kinds = [json.loads(line)["error"]["type"] for line in failed.read_text().splitlines()]
    assert kinds == ["MessageReturned", "MessageRejected"]
    assert "returned" in result.stdout and "rejected" in result.stdout


def test_failures_listed_on_stderr_without_failed_file(amqp_url: str, broker: BrokerAdmin) -> None:
    exchange = broker.exchange()
    result = run_cli(
        "publish",
        "--exchange",
        exchange,
        "--routing-key",
        "nowhere",
        "--mandatory",
        url=amqp_url,
        stdin=b"a\n",
    )
    assert result.returncode == 1
    assert "line 1: returned" in result.stderr


def test_help_and_version() -> None:
    result = run_cli("--help", url=None)
    assert result.returncode == 0 and "publish" in result.stdout and "bench" in result.stdout
    assert "exit codes" in result.stdout
    assert "With --failed PATH" not in result.stdout  # publish's note, in publish's --help
    publish_help = run_cli("publish", "--help", url=None)
    assert publish_help.returncode == 0 and "--failed" in publish_help.stdout
    assert "With --failed PATH" in publish_help.stdout
    assert "guest:guest" not in publish_help.stdout
    version = run_cli("--version", url=None)
    assert version.returncode == 0 and version.stdout.strip().startswith("reliable-amqp ")


@pytest.mark.faults
def test_connection_lost_for_good_exits_3_and_keeps_every_unconfirmed_message(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path, make_proxy: Any
) -> None:
    port = int(amqp_url.rpartition(":")[2].partition("/")[0])
    proxy = make_proxy(port)
    queue = broker.queue(
        **cast(dict[str, Any], {"x-max-length": 2, "x-overflow": "reject-publish"})
    )
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{i}\n" for i in range(1, 21)))
    failed = tmp_path / "failed.jsonl"
    env = {**os.environ, "AMQP_URL": proxy.url()}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reliable_amqp",
            "publish",
            str(source),
            "--routing-key",
            queue,
            "--nack-retries",
            "1000",
            "--retry-initial-delay",
            "0.2",
            "--retry-max-delay",
            "0.2",
            "--connect-retries",
            "0",
            "--failed",
            str(failed),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 30
    while broker.count(queue) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proxy.refuse()
    proxy.cut()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 3, err
    assert "guest:guest" not in out + err
    # the cause once (the 18 messages are in --failed, each with it)
    assert err.count("gave up connecting") == 1, err
    assert err.startswith(
        f"reliable-amqp: the connection to {proxy.url()}".replace("guest:guest", "guest:***")
    )
    records = [json.loads(line) for line in failed.read_text().splitlines()]
    assert [r["body"] for r in records] == [str(i) for i in range(3, 21)]
    assert {r["error"]["type"] for r in records} == {"PublisherClosed"}
    assert "not confirmed" in out


def test_with_a_spool_an_unreachable_broker_is_named_once(tmp_path: Path) -> None:
    # Nothing raises with a spool (the messages wait in it): the reason is still said, once.
    result = run_cli(
        "publish",
        "--routing-key",
        "q",
        "--spool",
        str(tmp_path / "spool"),
        "--connect-retries",
        "1",
        "-o",
        "connect_policy.initial_delay=0.05",
        url="amqp://guest:guest@127.0.0.1:1/%2F",
        stdin=b"a\nb\n",
    )
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == (
        "reliable-amqp: cannot connect to amqp://guest:***@127.0.0.1:1/%2F: gave up connecting "
        "after 2 attempts: connection refused at 127.0.0.1:1"
    )
    assert result.stderr.count("connection refused") == 1
    assert "2 messages stay in the spool" in lines[1]


def test_a_url_parameter_a_flag_replaces_names_the_flag(amqp_url: str) -> None:
    url = amqp_url + "?connection_attempts=3"
    result = run_cli("publish", "--routing-key", "q", "--url", url, url=None, stdin=b"x\n")
    assert result.returncode == 2
    assert "the URL parameter 'connection_attempts' is not accepted; use --connect-retries " in (
        result.stderr
    )
