"""What a user's log shows when connecting fails (issue 20, "failures that read well").

- ``logging.basicConfig(level=WARNING)`` and a refused port: at most one line per attempt (the
  library's own, naming the cause), none of pika's or aiormq's for the library's connections,
  and the final error once: raised, not also logged.
- pika's and aiormq's records about *other* connections in the same process (the user's own)
  are untouched, even while a publisher retries beside them.
- A connection that never opened is not called lost; one that was open and went away is.
- ``AuthenticationFailed`` names the user and the virtual host, never the password.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from reliable_amqp import (
    AsyncPublisher,
    AuthenticationFailed,
    MessageReturned,
    Publisher,
    PublisherClosed,
    RetryPolicy,
)
from reliable_amqp._core.builder import build_message
from reliable_amqp._spool import Spool, inspect
from support.aio_blocking import BlockingAsyncPublisher
from support.broker import unique
from support.spool import SpooledAsync

pytestmark = pytest.mark.broker


def refused_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# The child: basicConfig(WARNING), as a user's script has it; a user's own pika (or aiormq)
# connection to the refused port before, beside and after the publisher's attempts; the
# publisher's connect() error printed by the script, as a user prints it.
CHILD = """
    import asyncio, logging, sys, threading, time
    import pika, aiormq
    logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(name)s %(message)s")
    from reliable_amqp import AsyncPublisher, Publisher, RetryPolicy

    port, kind = int(sys.argv[1]), sys.argv[2]
    url = f"amqp://guest:s3cret-pw@127.0.0.1:{port}/%2F"
    policy = RetryPolicy(max_attempts=3, initial_delay=0.05, max_delay=0.05, jitter=0)

    def users_pika():  # the user's own connection, with pika's own logging
        try:
            pika.BlockingConnection(pika.URLParameters(url + "?connection_attempts=1"))
        except pika.exceptions.AMQPConnectionError:
            pass

    async def users_aiormq():
        try:
            await aiormq.connect(url)  # aiormq 7 logs this failure; 6.8 does not
        except ConnectionError:
            pass
        # a record on aiormq's logger from the user's own task, whatever aiormq's version
        logging.getLogger("aiormq.connection").warning("the user's own aiormq record")

    def mark(text):
        sys.stderr.flush(); print(f"MARK {text}", file=sys.stderr, flush=True)

    if kind == "sync":
        users_pika()
        mark("publisher")
        beside = threading.Thread(target=lambda: [users_pika() for _ in range(3)])
        beside.start()
        publisher = Publisher(url, connect_policy=policy)
        try:
            publisher.connect()
        except Exception as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        publisher.close()
        beside.join()
        mark("after")
        users_pika()
    else:
        async def main():
            await users_aiormq()
            mark("publisher")
            beside = asyncio.ensure_future(asyncio.gather(*(users_aiormq() for _ in range(3))))
            publisher = AsyncPublisher(url, connect_policy=policy)
            try:
                await publisher.connect()
            except Exception as exc:
                print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
            await publisher.aclose()
            await beside
            mark("after")
            await users_aiormq()
        asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refused_port_costs_one_line_per_attempt_and_the_error_once(kind: str) -> None:
    port = refused_port()
    result = run_child(CHILD, str(port), kind)
    assert result.returncode == 0, result.stderr
    cause = f"connection refused at 127.0.0.1:{port}"
    # the final error: once, one line, the cause in words, no class names of pika or aiormq
    assert result.stdout == f"ERROR RecoveryFailed: gave up connecting after 3 attempts: {cause}\n"
    before, _, rest = result.stderr.partition("MARK publisher\n")
    during, _, after = rest.partition("MARK after\n")
    client = "pika." if kind == "sync" else "aiormq."

    def records(text: str) -> list[str]:  # "LOG ERROR pika.adapters...": level and logger
        return [" ".join(line.split()[:3]) for line in text.splitlines() if line.startswith("LOG")]

    users_lines = records(before)
    # the user's own connection logs through pika/aiormq as it always did, before and after
    assert users_lines and all(client in line for line in users_lines)
    assert records(after) == users_lines
    ours = [line for line in during.splitlines() if "reliable_amqp" in line]
    theirs = [line for line in records(during) if client in line]
    # attempts 1 and 2 failed with a retry: one WARNING each; attempt 3's failure is the
    # error the script printed, not logged again (not at ERROR, not at all at WARNING)
    assert ours == [
        f"LOG WARNING reliable_amqp reliable-amqp: cannot connect to "
        f"amqp://guest:***@127.0.0.1:{port}/%2F: {cause}; attempt {n} in 0.05 s"
        for n in (2, 3)
    ]
    # beside the publisher, the user's three attempts logged exactly as the one before did
    assert len(theirs) == 3 * len(users_lines)
    # and nothing else: no traceback beyond those of the user's own records, no "lost"
    assert len(during.splitlines()) == 3 * len(before.splitlines()) + len(ours)
    assert "lost" not in during
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_the_client_libraries_records_are_relayed_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A DEBUG configuration of reliable_amqp still sees what pika said, as its own DEBUG records;
    # pika's own loggers show nothing of it, not even from the thread pika resolves names on.
    caplog.set_level(logging.DEBUG)
    port = refused_port()
    for url, cause in (
        (f"amqp://127.0.0.1:{port}/", f"connection refused at 127.0.0.1:{port}"),
        ("amqp://no-such-host.invalid/", "cannot resolve the host name 'no-such-host.invalid'"),
    ):
        caplog.clear()
        publisher = Publisher(url, connect_policy=RetryPolicy(max_attempts=1))
        with pytest.raises(Exception, match=cause):
            publisher.connect()
        publisher.close()
        relayed = [r for r in caplog.records if r.name == "reliable_amqp.client"]
        assert relayed and all(r.levelno == logging.DEBUG for r in relayed)
        assert any("pika.adapters" in r.getMessage() for r in relayed)
        assert not [r for r in caplog.records if r.name.startswith("pika")]


@pytest.mark.faults
def test_only_a_connection_that_was_open_is_called_lost(
    caplog: pytest.LogCaptureFixture, make_proxy: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="reliable_amqp")
    proxy = make_proxy()
    policy = RetryPolicy(max_attempts=3, initial_delay=0.05, max_delay=0.05, jitter=0)
    publisher = Publisher(proxy.url(), connect_policy=policy)
    publisher.connect()
    port = proxy.port
    proxy.close()  # resets the connection and stops listening: the port refuses from now on
    with pytest.raises(Exception, match=f"connection refused at 127.0.0.1:{port}"):
        publisher.publish("", unique("nowhere"), b"x", mandatory=False).result(timeout=30)
    publisher.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "reliable_amqp"]
    assert len(lines) == 2 and all(r.levelno == logging.WARNING for r in caplog.records)
    where = f"amqp://guest:***@127.0.0.1:{port}/%2F"
    assert lines[0] in [
        f"reliable-amqp: connection to {where} lost: connection {how} by 127.0.0.1:{port}; "
        "attempt 2 in 0.05 s"
        for how in ("reset", "closed")  # the proxy resets; a FIN would read "closed"
    ], lines[0]
    assert lines[1] == (
        f"reliable-amqp: cannot connect to {where}: connection refused at "
        f"127.0.0.1:{port}; attempt 3 in 0.05 s"
    )


def test_authentication_failed_names_the_user_and_vhost_never_the_password(
    amqp_url: str,
) -> None:
    host = amqp_url.rpartition("@")[2].partition("/")[0]
    wrong = f"amqp://guest:wrong-pw-77@{host}/%2F"
    vhost = unique("no-such-vhost")
    no_vhost = f"amqp://guest:guest@{host}/{vhost}"
    policy = RetryPolicy(max_attempts=1)
    for url, text in (
        (wrong, "the broker refused the credentials of user 'guest' on virtual host '/'"),
        (no_vhost, f"the broker refused user 'guest' access to the virtual host {vhost!r}"),
    ):
        publisher = Publisher(url, connect_policy=policy)
        with pytest.raises(AuthenticationFailed) as sync_error:
            publisher.connect()
        publisher.close()

        async def connect_async(url: str = url) -> BaseException:
            publisher = AsyncPublisher(url, connect_policy=policy)
            try:
                await publisher.connect()
            except AuthenticationFailed as exc:
                return exc
            finally:
                await publisher.aclose()
            raise AssertionError("connected")

        async_error = asyncio.run(connect_async())
        for error in (sync_error.value, async_error):
            assert str(error).startswith(text), str(error)
            if url == wrong:  # both publishers say the broker's reply alike, code included
                assert "(wrong user or password): 403 ACCESS_REFUSED - " in str(error)
            assert "Error" not in str(error)  # no client-library class names
            assert "wrong-pw-77" not in str(error) and "guest:guest" not in str(error)


# --- issue 33: every failure speaks once ----------------------------------------------------------

TESTS = str(Path(__file__).parent)

# The child: each failure kind in turn on one publisher (sync or async), with logging left
# unconfigured or at basicConfig(WARNING); what the caller gets is printed on stdout, and a
# marker on stderr before each kind, so that every line on stderr belongs to one kind.
KINDS_CHILD = """
    import asyncio, logging, sys
    sys.path.insert(0, sys.argv[1])
    from harness.proxy import TcpProxy
    from reliable_amqp import AsyncPublisher, Publisher, ReliableAmqpError

    tests, side, mode, url, queue, full = sys.argv[1:]
    if mode == "basic":
        logging.basicConfig(level=logging.WARNING)
    host = url.rpartition("@")[2].partition("/")[0]
    port = int(host.rpartition(":")[2])

    def cases():
        yield "404", url, {}, ("no-such-exchange-" + queue, "k", b"x")
        yield "406", url, {}, ("", queue, bytes(128 * 1024 * 1024 + 1))  # over max_message_size
        yield "return", url, {}, ("", "no-such-queue-" + queue, b"x")
        yield "nack", url, {"nack_policy": {"max_attempts": 1}}, ("", full, b"x")
        yield "timeout", "stall", {"delivery_timeout": 1.0}, ("", queue, b"x")
        yield "auth", f"amqp://guest:wrong@{host}/%2F", {}, ("", queue, b"x")

    def mark(kind):
        sys.stderr.flush()
        print(f"=== {kind}", file=sys.stderr, flush=True)

    def sync_case(target, options, args, proxy):
        try:
            with Publisher(target, **options) as publisher:
                future = publisher.publish(*args)
                if proxy is not None:
                    proxy.stall()
                try:
                    future.result(60)
                    return "confirmed"
                finally:
                    if proxy is not None:
                        proxy.resume()
        except ReliableAmqpError as exc:
            return type(exc).__name__

    async def async_case(target, options, args, proxy):
        try:
            async with AsyncPublisher(target, **options) as publisher:
                future = await publisher.publish(*args)
                if proxy is not None:
                    proxy.stall()
                try:
                    await asyncio.wait_for(future, 60)
                    return "confirmed"
                finally:
                    if proxy is not None:
                        proxy.resume()
        except ReliableAmqpError as exc:
            return type(exc).__name__

    for kind, target, options, args in cases():
        mark(kind)
        proxy = None
        if target == "stall":  # connects, then no byte moves: no confirm ever comes
            proxy = TcpProxy(port).start()
            target = proxy.url()
        if side == "sync":
            got = sync_case(target, options, args, proxy)
        else:
            got = asyncio.run(async_case(target, options, args, proxy))
        if proxy is not None:
            proxy.close()
        print(kind, got, flush=True)
    mark("end")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["unconfigured", "basic"])
@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_failure_the_caller_gets_is_not_also_logged(
    side: str, mode: str, amqp_url: str, broker: Any
) -> None:
    queue = broker.queue()
    full = broker.queue(**{"x-max-length": 0, "x-overflow": "reject-publish"})
    args = (TESTS, side, mode, amqp_url, queue, full)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KINDS_CHILD), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "404 MessageRejected",
        "406 MessageRejected",
        "return MessageReturned",
        "nack MessageNacked",
        "timeout DeliveryTimeout",
        "auth AuthenticationFailed",
    ]
    # raise or log: the caller holds each failure, so nothing about it is written anywhere,
    # neither by Python's last-resort handler (unconfigured) nor at WARNING
    said: dict[str, list[str]] = {}
    kind = ""
    for line in result.stderr.splitlines():
        if line.startswith("=== "):
            kind = line[4:]
            said[kind] = []
        else:
            said[kind].append(line)
    assert said == {k: [] for k in ("404", "406", "return", "nack", "timeout", "auth", "end")}


# The child: one message no queue takes, its future dropped unchecked (as a script that only
# wanted to send it does), one checked, one confirmed; then, with a spool, nothing else.
UNCHECKED_CHILD = """
    import asyncio, gc, sys
    from reliable_amqp import AsyncPublisher, Publisher

    side, url, queue, nowhere = sys.argv[1:]

    if side == "sync":
        with Publisher(url) as publisher:
            publisher.publish("", nowhere, b"x", message_id="the-unchecked-one")
            checked = publisher.publish("", nowhere, b"y", message_id="the-checked-one")
            confirmed = publisher.publish("", queue, b"z", message_id="the-confirmed-one")
            publisher.flush(30)
        print(type(checked.exception()).__name__, confirmed.result().message_id)
    else:
        async def main():
            async with AsyncPublisher(url) as publisher:
                await publisher.publish("", nowhere, b"x", message_id="the-unchecked-one")
                checked = await publisher.publish("", nowhere, b"y", message_id="the-checked-one")
                confirmed = await publisher.publish("", queue, b"z", message_id="the-confirmed-one")
                await publisher.flush(30)
            print(type(checked.exception()).__name__, (await confirmed).message_id)
        asyncio.run(main())
    gc.collect()
    print("end", flush=True)
"""


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_failure_nobody_retrieves_is_reported_once(side: str, amqp_url: str, broker: Any) -> None:
    queue = broker.queue()
    result = run_child(UNCHECKED_CHILD, side, amqp_url, queue, unique("nowhere"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "MessageReturned the-confirmed-one\nend\n"
    # asyncio's words on both sides (Python's last-resort handler prints the message alone)
    lines = result.stderr.splitlines()
    assert lines.count("Future exception was never retrieved") == 1, result.stderr
    assert len(lines) == 3, result.stderr
    assert lines[1].startswith("future: <Future finished exception=MessageReturned(")
    assert "'the-unchecked-one'" in lines[1] and "NO_ROUTE" in lines[1]
    assert lines[2].startswith("reliable_amqp._core.errors.MessageReturned: message ")
    assert "the-checked-one" not in result.stderr


def test_a_sync_failure_is_one_warning_and_costs_nothing_once_retrieved(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    nowhere = unique("nowhere")
    with Publisher(amqp_url) as publisher:
        futures = [publisher.publish("", nowhere, b"x", message_id=f"m-{i}") for i in range(3)]
        assert publisher.flush(30) == 0
    assert isinstance(futures[0].exception(), MessageReturned)  # retrieved: never reported
    with pytest.raises(MessageReturned):
        futures[1].result()
    del futures[:2]
    gc.collect()
    assert caplog.records == []
    futures.clear()  # the third: never looked at
    gc.collect()
    [record] = caplog.records
    assert (record.name, record.levelno) == ("reliable_amqp", logging.WARNING)
    assert record.getMessage().startswith("Future exception was never retrieved\nfuture: <")
    assert "'m-2'" in record.getMessage()


@pytest.mark.parametrize("side", ["sync", "async"])
def test_recovered_messages_that_fail_are_logged_once_each(
    side: str, amqp_url: str, broker: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    spool = Spool(tmp_path / "s")
    queue = broker.queue()
    for i in range(4):
        key = queue if i % 2 else unique("no-such-queue")
        spool.append(build_message("", key, b"%d" % i, properties={"message_id": f"m-{i}"}))
    spool.close()
    caplog.clear()
    kind = Publisher if side == "sync" else BlockingAsyncPublisher
    with kind(amqp_url, spool=tmp_path / "s") as publisher:
        assert publisher.flush(30) == 0
    gc.collect()
    lines = sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert [line.partition(" moved")[0] for line in lines[:2]] == [
        "reliable-amqp: recovered message 'm-0'",
        "reliable-amqp: recovered message 'm-2'",
    ]
    assert all("to the spool's failed table: message" in line for line in lines[:2])
    assert all("NO_ROUTE" in line for line in lines[:2])
    assert len(lines) == 3 and lines[2].startswith("reliable-amqp: spool ")  # "holds 4 ..."
    assert "Future exception" not in caplog.text
    assert inspect(tmp_path / "s").failed == 2


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_spooled_message_the_close_fails_says_it_stays_in_the_spool(
    side: str, make_proxy: Any, tmp_path: Path
) -> None:
    proxy = make_proxy()
    kind = Publisher if side == "sync" else SpooledAsync
    publisher = kind(proxy.url(), spool=tmp_path / "s")
    publisher.connect()
    # stalled before the publish: the message never reaches the broker, whose answer (a return,
    # no queue being bound) would otherwise settle it before the close when the stall came late
    proxy.stall()
    future = publisher.publish("", unique("q"), b"x", message_id="kept")
    assert publisher.persist(30) == 0
    publisher.close(timeout=0.2)  # in flight, no confirm: the close fails it
    proxy.resume()
    error = future.exception(10)
    assert isinstance(error, PublisherClosed)
    assert f"stays in the spool {tmp_path / 's'}" in str(error), str(error)
    assert inspect(tmp_path / "s").pending == 1
