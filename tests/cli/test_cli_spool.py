"""`reliable-amqp spool DIR`: counts, --export-failed (JSON lines `publish --format jsonl`
accepts, message ids kept), --drop-failed (refused while a publisher has the spool open)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.message import OutgoingMessage
from reliable_amqp._spool import Spool, _files
from reliable_amqp.cli._io import Defaults, read_messages
from support.broker import BrokerAdmin, unique


def run_cli(*args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_AMQP_")}
    env.pop("AMQP_URL", None)
    if url is not None:
        env["AMQP_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "reliable_amqp", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _spool_with_failures(directory: Path, routing_key: str = "q") -> list[OutgoingMessage]:
    """A spool with 6 pending and 4 failed messages; returns the failed ones, in order."""
    sent = [
        build_message(
            "",
            routing_key,
            body,
            mandatory=n % 2 == 0,
            properties={
                "message_id": f"id-{n}",
                "content_type": "application/octet-stream",
                "headers": {"n": n, "text": "é", "flag": True},
                "priority": 3,
                "timestamp": 1_700_000_000 + n,
            },
        )
        for n, body in enumerate([b"plain text", b"\x00\xffbinary", b"", "ünï".encode()] * 3)
        if n < 10
    ]
    spool = Spool(directory)
    for message in sent:
        spool.append(message)
    spool.persist()
    failed = [2, 3, 5, 8]
    for seq in failed:
        spool.fail(seq, sent[seq - 1], f"returned: 312 NO_ROUTE (seq {seq})")
    spool.close()
    return [sent[seq - 1] for seq in failed]


def test_counts(tmp_path: Path) -> None:
    _spool_with_failures(tmp_path / "s")
    result = run_cli("spool", str(tmp_path / "s"))
    assert result.returncode == 0, result.stderr
    assert "not in use" in result.stdout
    lines = result.stdout.splitlines()
    assert lines[1].split()[:3] == ["pending", "6", "messages"]
    assert lines[2].split()[:3] == ["failed", "4", "messages"]
    shown = json.loads(run_cli("spool", str(tmp_path / "s"), "--json").stdout)
    assert (shown["pending"], shown["failed"], shown["in_use_by"]) == (6, 4, None)
    assert shown["pending_bytes"] > 0 and shown["failed_bytes"] > 0


def test_export_failed_writes_what_publish_reads_back_equal(tmp_path: Path) -> None:
    failed = _spool_with_failures(tmp_path / "s")
    out = tmp_path / "failed.jsonl"
    result = run_cli("spool", str(tmp_path / "s"), "--export-failed", str(out))
    assert result.returncode == 0, result.stderr
    assert "4 failed messages written" in result.stdout
    assert out.stat().st_mode & 0o777 == 0o600
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["error"]["reason"] for r in records] == [
        f"returned: 312 NO_ROUTE (seq {seq})" for seq in (2, 3, 5, 8)
    ]
    items = read_messages(io.BytesIO(out.read_bytes()), str(out), "jsonl", Defaults())
    assert [item.message for item in items] == failed  # bodies, properties, ids, mandatory
    # exporting does not drop
    assert json.loads(run_cli("spool", str(tmp_path / "s"), "--json").stdout)["failed"] == 4


def test_drop_failed_drops_exactly_what_was_exported(tmp_path: Path) -> None:
    _spool_with_failures(tmp_path / "s")
    out = tmp_path / "failed.jsonl"
    result = run_cli(
        "spool", str(tmp_path / "s"), "--export-failed", str(out), "--drop-failed", "--json"
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["exported"], shown["dropped"], shown["failed"], shown["pending"]) == (4, 4, 0, 6)
    result = run_cli("spool", str(tmp_path / "s"), "--drop-failed")
    assert result.returncode == 0, result.stderr
    assert "0 failed messages dropped" in result.stdout


def test_export_and_drop_say_what_they_did_before_the_counts_after(tmp_path: Path) -> None:
    _spool_with_failures(tmp_path / "s")
    out = tmp_path / "failed.jsonl"
    result = run_cli("spool", str(tmp_path / "s"), "--export-failed", str(out), "--drop-failed")
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    written = next(i for i, line in enumerate(lines) if "4 failed messages written" in line)
    dropped = lines.index("4 failed messages dropped")
    counts = next(i for i, line in enumerate(lines) if line.startswith("failed "))
    assert written < dropped < counts  # not "failed 0" first, then where the 4 went
    assert lines[counts].split()[:2] == ["failed", "0"]


def test_drop_failed_is_refused_while_a_publisher_holds_the_spool(tmp_path: Path) -> None:
    _spool_with_failures(tmp_path / "s")
    spool = Spool(tmp_path / "s")  # this process holds the lock
    try:
        shown = run_cli("spool", str(tmp_path / "s"))  # reading is fine
        assert shown.returncode == 0
        assert f"in use by process {os.getpid()}" in shown.stdout
        result = run_cli("spool", str(tmp_path / "s"), "--drop-failed")
        assert result.returncode == 2
        assert f"in use by process {os.getpid()}" in result.stderr
    finally:
        spool.close()
    assert json.loads(run_cli("spool", str(tmp_path / "s"), "--json").stdout)["failed"] == 4


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "no spool"), (b"garbage" * 1000, "not a database")],
)
def test_a_missing_or_damaged_spool_exits_2_naming_it(
    tmp_path: Path, content: bytes | None, expected: str
) -> None:
    (tmp_path / "s").mkdir()
    if content is not None:
        (tmp_path / "s" / "spool.db").write_bytes(content)
    result = run_cli("spool", str(tmp_path / "s"))
    assert result.returncode == 2
    assert expected in result.stderr
    assert str(tmp_path / "s") in result.stderr


def test_check_names_damaged_entries(tmp_path: Path) -> None:
    _spool_with_failures(tmp_path / "s")
    result = run_cli("spool", str(tmp_path / "s"), "--check")
    assert result.returncode == 0, result.stderr
    assert "check: no problems" in result.stdout
    # a flipped byte in the bodies of pending entries 4 and 9, in the record of failed entry 5
    segment = tmp_path / "s" / _files.segment_name(1)
    data = bytearray(segment.read_bytes())
    found = {
        f.seq: f for f in _files.records(str(segment), 16, len(data)) if isinstance(f, _files.Found)
    }
    for seq in (4, 9):
        data[found[seq].end - 1] ^= 0x01
    segment.write_bytes(bytes(data))
    failed_log = tmp_path / "s" / _files.FAILED_NAME
    data = bytearray(failed_log.read_bytes())
    data[data.index(b"(seq 5)") + 2] ^= 0x01
    failed_log.write_bytes(bytes(data))
    result = run_cli("spool", str(tmp_path / "s"), "--check")
    assert result.returncode == 1
    damaged = [line for line in result.stdout.splitlines() if line.startswith("damaged:")]
    assert len(damaged) == 3
    assert f"{segment}: entry 4 at byte {found[4].offset} is damaged" in damaged[0]
    assert f"{segment}: entry 9 at byte {found[9].offset} is damaged" in damaged[1]
    assert f"{failed_log}: failed entry 5 is damaged" in damaged[2]
    shown = json.loads(run_cli("spool", str(tmp_path / "s"), "--check", "--json").stdout)
    assert len(shown["problems"]) == 3


@pytest.mark.broker
def test_exported_messages_publish_again_with_their_ids(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    failed = _spool_with_failures(tmp_path / "s", routing_key=queue)
    out = tmp_path / "failed.jsonl"
    assert run_cli("spool", str(tmp_path / "s"), "--export-failed", str(out)).returncode == 0
    result = run_cli("publish", "--format", "jsonl", str(out), url=amqp_url)
    assert result.returncode == 0, result.stderr
    got = broker.drain(queue)
    assert [(props.message_id, body) for props, body in got] == [
        (m.message_id, m.body) for m in failed
    ]


def run_publish(*args: str, url: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELIABLE_AMQP_")}
    env["AMQP_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "reliable_amqp", "publish", *args],
        input=stdin,
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.broker
def test_publish_with_a_spool_leaves_it_empty(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    lines = "".join(f"line {i}\n" for i in range(500))
    result = run_publish(
        "--routing-key", queue, "--spool", str(tmp_path / "s"), url=amqp_url, stdin=lines
    )
    assert result.returncode == 0, result.stderr
    assert [body for _, body in broker.drain(queue)] == [f"line {i}".encode() for i in range(500)]
    shown = json.loads(run_cli("spool", str(tmp_path / "s"), "--json").stdout)
    assert (shown["pending"], shown["failed"]) == (0, 0)


@pytest.mark.broker
def test_what_an_unreachable_broker_left_goes_out_with_the_next_run(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    spool = str(tmp_path / "s")
    lines = "".join(f"line {i}\n" for i in range(300))
    down = run_publish(
        "--routing-key",
        queue,
        "--spool",
        spool,
        "-o",
        "connect_policy.max_attempts=2",
        url="amqp://guest:guest@127.0.0.1:1/%2F",
        stdin=lines,
    )
    assert down.returncode == 3, down.stderr
    assert f"300 messages stay in the spool {spool}" in down.stderr
    # what the spool keeps is neither listed as failed nor pointed to --failed (sent twice)
    assert "--failed" not in down.stderr + down.stdout
    assert "line 1:" not in down.stderr
    assert _row(down.stdout, "in the spool") == 300
    assert json.loads(run_cli("spool", spool, "--json").stdout)["pending"] == 300
    # the next run, broker up, with nothing new to send
    up = run_publish("--routing-key", queue, "--spool", spool, url=amqp_url, stdin="")
    assert up.returncode == 0, up.stderr
    assert [body for _, body in broker.drain(queue)] == [f"line {i}".encode() for i in range(300)]
    assert f"300 messages recovered from the spool {spool}" in up.stdout
    assert _row(up.stdout, "confirmed", after="recovered") == 300
    assert json.loads(run_cli("spool", spool, "--json").stdout)["pending"] == 0


def _row(summary: str, label: str, after: str | None = None) -> int:
    """The count of the summary row ``label`` (the first after a line containing ``after``)."""
    lines = summary.splitlines()
    if after is not None:
        lines = lines[next(i for i, line in enumerate(lines) if after in line) :]
    for line in lines:
        if line.strip().startswith(label):
            return int(line.strip()[len(label) :].split()[0].replace(",", ""))
    raise AssertionError(f"no {label!r} row in:\n{summary}")


@pytest.mark.broker
def test_recovered_messages_wait_for_declare_queue_and_are_counted(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = unique("later")  # does not exist until the run declares it
    directory = tmp_path / "s"
    spool = Spool(directory)
    for i in range(5000):
        spool.append(build_message("", queue, b"%d" % i, properties={"message_id": f"m-{i}"}))
    spool.close()
    result = run_publish(
        "--declare-queue", queue, "--spool", str(directory), url=amqp_url, stdin=""
    )
    broker.queue(queue)  # (the same declaration, so that the test deletes it after)
    assert result.returncode == 0, result.stderr
    assert [p.message_id for p, _ in broker.drain(queue)] == [f"m-{i}" for i in range(5000)]
    assert f"5,000 messages recovered from the spool {directory}" in result.stdout
    assert _row(result.stdout, "confirmed", after="recovered") == 5000
    assert "failed" not in result.stdout.split("recovered")[1]
    shown = json.loads(run_cli("spool", str(directory), "--json").stdout)
    assert (shown["pending"], shown["failed"]) == (0, 0)


@pytest.mark.broker
def test_recovered_messages_that_fail_are_counted_and_kept(
    amqp_url: str, broker: BrokerAdmin, tmp_path: Path
) -> None:
    queue = broker.queue()
    missing = unique("no-such-exchange")
    directory = tmp_path / "s"
    spool = Spool(directory)
    for i in range(10):
        spool.append(
            build_message(
                missing if i == 3 else "", queue, b"%d" % i, properties={"message_id": f"m-{i}"}
            )
        )
    spool.close()
    result = run_publish(
        "--routing-key", queue, "--spool", str(directory), url=amqp_url, stdin="own\n"
    )
    assert result.returncode == 1, result.stderr
    got = list(dict.fromkeys(p.message_id for p, _ in broker.drain(queue)))
    assert got[:9] == [f"m-{i}" for i in range(10) if i != 3]
    assert len(got) == 10  # and the run's own message
    assert _row(result.stdout, "confirmed", after="recovered") == 9
    assert _row(result.stdout, "failed", after="recovered") == 1
    assert "recovered from the spool and failed: 1 message" in result.stderr
    assert "--export-failed" in result.stderr
    assert "--failed" not in result.stderr.replace("--export-failed", "")
    out = tmp_path / "failed.jsonl"
    assert run_cli("spool", str(directory), "--export-failed", str(out)).returncode == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["message_id"] == "m-3"
    assert "404" in record["error"]["reason"] and missing in record["error"]["reason"]
