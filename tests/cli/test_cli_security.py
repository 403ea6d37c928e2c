"""`reliable-amqp publish`: configuration errors exit 2 in one line, credentials outside the URL,
the --failed file is private and never written through a symlink, broker text is escaped."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from support.broker import AMQP_HOSTPORT, BrokerAdmin
from support.cli import run_cli

pytestmark = pytest.mark.broker

HOST = AMQP_HOSTPORT  # the test broker's host:port, for URLs with other credentials
#: a password with every character that breaks a URL, and the fragments that must never show
SECRET = "Zq7/Xw9?Yv8#Ut6@Sr5"
FRAGMENTS = ("Zq7", "Xw9", "Yv8", "Ut6", "Sr5")


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        for fragment in FRAGMENTS:
            assert fragment not in text


# --- exit 2, one line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, message",
    [
        (
            f"amqp://guest:{SECRET}@{HOST}/",
            f"reliable-amqp publish: error: malformed broker URL amqp://guest:***@{HOST}/:"
            " the port is not a number; a password holding '/', '?', '#', '@' or ':' must be "
            "percent-encoded (%2F, %3F, %23, %40, %3A), or given as the password option instead",
        ),
        (
            f"amqp://guest:guest@{HOST}/%2F?no_verify_ssl=1",
            f"reliable-amqp publish: error: broker URL amqp://guest:***@{HOST}/%2F?"
            "no_verify_ssl=***: the URL parameter 'no_verify_ssl' configures TLS, which URLs may "
            "not do; use the publisher options ca_file, cert_file, key_file, key_password, "
            "server_hostname, tls_verify or ssl_context instead",
        ),
        (
            f"amqps://guest:guest@{HOST}/%2F?ssl_options=%7B%27password%27%3A%27Zq7Xw9%27%7D",
            f"reliable-amqp publish: error: broker URL amqps://guest:***@{HOST}/%2F?"
            "ssl_options=***: the URL parameter 'ssl_options' configures TLS, which URLs may not "
            "do; use the publisher options ca_file, cert_file, key_file, key_password, "
            "server_hostname, tls_verify or ssl_context instead",
        ),
        (
            f"amqp://guest:guest@{HOST}/%2F?frame_max=Zq7",
            f"reliable-amqp publish: error: broker URL amqp://guest:***@{HOST}/%2F?"
            "frame_max=***: unknown URL parameter 'frame_max' (a URL may only carry heartbeat; "
            "everything else is a publisher option)",
        ),
        (
            f"amqp://guest:guest@{HOST}/%2F?connection_attempts=3",
            f"reliable-amqp publish: error: broker URL amqp://guest:***@{HOST}/%2F?"
            "connection_attempts=3: the URL parameter 'connection_attempts' is not accepted; "
            "use --connect-retries instead",
        ),
    ],
)
def test_a_bad_url_exits_2_with_one_line(url: str, message: str) -> None:
    result = run_cli("publish", "--routing-key", "q", url=url, stdin=b"a\n")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n")
    assert_no_secret(result.stderr)


def test_a_bad_tls_option_exits_2(amqp_url: str, tmp_path: Path) -> None:
    result = run_cli(
        "publish", "--routing-key", "q", "--ca-file", str(tmp_path / "none.pem"),
        url=amqp_url, stdin=b"a\n",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "reliable-amqp publish: error: ca_file set but no broker URL uses TLS: write amqps://\n"
    )


def test_an_unreadable_ca_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "none.pem"
    result = run_cli(
        "publish", "--routing-key", "q", "--ca-file", str(missing),
        url=f"amqps://guest:guest@{HOST}/", stdin=b"a\n",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"reliable-amqp publish: error: cannot load ca_file '{missing}': No such file or "
        "directory\n"
    )


# --- credentials outside the URL --------------------------------------------------------------


def test_amqp_password_and_username_override_the_url(broker: BrokerAdmin) -> None:
    queue = broker.queue()
    result = run_cli(
        "publish", "--routing-key", queue, url=f"amqp://nobody:wrong@{HOST}/%2F",
        stdin=b"a\n", env={"AMQP_USERNAME": "guest", "AMQP_PASSWORD": "guest"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [body for _, body in broker.drain(queue)] == [b"a"]


def test_password_file_wins_over_amqp_password(broker: BrokerAdmin, tmp_path: Path) -> None:
    queue = broker.queue()
    secret = tmp_path / "password"
    secret.write_text("guest\n")
    result = run_cli(
        "publish", "--routing-key", queue, "--password-file", str(secret),
        url=f"amqp://guest@{HOST}/%2F", stdin=b"a\n", env={"AMQP_PASSWORD": SECRET},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [body for _, body in broker.drain(queue)] == [b"a"]


def test_a_wrong_password_is_never_printed_nor_written(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text(SECRET + "\n")
    failed = tmp_path / "failed.jsonl"
    result = run_cli(
        "publish", "--routing-key", "q", "--password-file", str(secret), "--failed", str(failed),
        "--connect-retries", "0", "-v",
        url=f"amqp://guest@{HOST}/%2F", stdin=b"a\n",
    )  # fmt: skip
    assert result.returncode == 3
    assert "the broker refused the credentials" in result.stderr
    assert_no_secret(result.stdout, result.stderr, failed.read_text())


def test_a_missing_password_file_exits_2(tmp_path: Path) -> None:
    result = run_cli(
        "publish", "--routing-key", "q", "--password-file", str(tmp_path / "nope"),
        url=f"amqp://guest@{HOST}/%2F", stdin=b"a\n",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"reliable-amqp publish: error: cannot read --password-file {tmp_path / 'nope'}: "
        "No such file or directory\n"
    )


# --- the --failed file --------------------------------------------------------------------------


def test_failed_file_is_created_0600_and_made_0600(amqp_url: str, tmp_path: Path) -> None:
    failed = tmp_path / "failed.jsonl"
    failed.write_text("old\n")
    failed.chmod(0o644)
    result = run_cli(
        "publish", "--routing-key", "no-such-queue-here", "--mandatory", "--failed", str(failed),
        url=amqp_url, stdin=b"a\n",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert stat.S_IMODE(failed.stat().st_mode) == 0o600
    [record] = [json.loads(line) for line in failed.read_text().splitlines()]
    assert record["error"]["type"] == "MessageReturned"
    fresh = tmp_path / "fresh.jsonl"
    result = run_cli(
        "publish", "--routing-key", "no-such-queue-here", "--mandatory", "--failed", str(fresh),
        url=amqp_url, stdin=b"a\n",
    )  # fmt: skip
    assert result.returncode == 1 and stat.S_IMODE(fresh.stat().st_mode) == 0o600


def test_failed_file_refuses_a_symlink(amqp_url: str, broker: BrokerAdmin, tmp_path: Path) -> None:
    queue = broker.queue()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    link = tmp_path / "failed.jsonl"
    link.symlink_to(target)
    result = run_cli(
        "publish", "--routing-key", queue, "--failed", str(link),
        url=amqp_url, stdin=b"a\n",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"reliable-amqp publish: error: refusing to write --failed {link}: it is a symbolic link\n"
    )
    assert target.read_text() == "keep me\n"
    assert broker.drain(queue) == []  # nothing was published


# --- broker text is escaped ---------------------------------------------------------------------


def test_reply_text_from_the_broker_is_escaped(amqp_url: str, tmp_path: Path) -> None:
    exchange = "no-such-\x1b[2J\x1b]0;owned\x07-exchange"
    line = json.dumps({"body": "x", "exchange": exchange, "routing_key": "k"})
    result = run_cli("publish", "--format", "jsonl", url=amqp_url, stdin=line.encode() + b"\n")
    assert result.returncode == 1
    assert "\x1b" not in result.stderr + result.stdout and "\x07" not in result.stderr
    # The broker's own words, escaped: RabbitMQ says "no exchange", LavinMQ "No exchange".
    escaped = "'no-such-\\x1b[2J\\x1b]0;owned\\x07-exchange'"
    said = re.search(f"404 NOT_FOUND - [Nn]o exchange {re.escape(escaped)} in vhost", result.stderr)
    assert said, result.stderr
