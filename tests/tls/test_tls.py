"""Both publishers over TLS against a disposable RabbitMQ node with a TLS listener.

Successes confirm a message; every failure is a TlsError, naming the host and the reason, raised
well within 10 s, with the default connect policy: it is not retried.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pika
import pytest

from harness.node import DisposableBroker, TlsListener
from reliable_amqp import Confirmation, Consumer, Delivery, Publisher, TlsError
from support.broker import AMQP_DEFAULT_PORT
from support.tls import PUBLISHERS, Certificates, client_context, publish_one

pytestmark = [
    pytest.mark.broker,
    pytest.mark.rabbitmq_only(reason="a disposable RabbitMQ node of its own, with a TLS listener"),
]

SELF_SIGNED = "certificate verify failed: self-signed certificate in certificate chain"
NOT_TLS = f"the port does not speak TLS (is it the plain AMQP port, {AMQP_DEFAULT_PORT}?)"


@pytest.fixture(scope="module")
def node(certificates: Certificates) -> Iterator[DisposableBroker]:
    """One node per module: a plain and a TLS listener, server authentication only."""
    tls = TlsListener(certificates.ca_file, certificates.server_cert, certificates.server_key)
    with DisposableBroker(tls=tls) as broker:
        yield broker


def expected(kind: str, host: str, port: int, reason: str) -> set[str]:
    """Both publishers name host and port."""
    return {f"TLS failed: {host}:{port}: {reason}"}


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_a_trusted_ca_file_confirms(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(kind, node.tls_url(), ca_file=str(certificates.ca_file))
    assert outcome.error is None
    assert isinstance(outcome.confirmation, Confirmation)


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_an_ssl_context_confirms(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(kind, node.tls_url(), ssl_context=client_context(certificates))
    assert outcome.error is None
    assert isinstance(outcome.confirmation, Confirmation)


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_server_hostname_names_the_certificate_when_connecting_by_address(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(
        kind,
        node.tls_url("127.0.0.1"),
        ca_file=str(certificates.ca_file),
        server_hostname="localhost",
    )
    assert outcome.error is None
    assert isinstance(outcome.confirmation, Confirmation)


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_an_unknown_ca_fails_at_once(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(kind, node.tls_url(), ca_file=str(certificates.other_ca_file))
    assert type(outcome.error) is TlsError and outcome.error.retriable is False
    assert str(outcome.error) in expected(kind, "localhost", node.tls_port, SELF_SIGNED)
    assert outcome.seconds < 10


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_the_system_cas_do_not_trust_a_private_ca(kind: str, node: DisposableBroker) -> None:
    outcome = publish_one(kind, node.tls_url())
    assert type(outcome.error) is TlsError
    assert str(outcome.error) in expected(kind, "localhost", node.tls_port, SELF_SIGNED)
    assert outcome.seconds < 10


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_a_host_the_certificate_does_not_name_fails(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(kind, node.tls_url("127.0.0.1"), ca_file=str(certificates.ca_file))
    reason = (
        "certificate verify failed: IP address mismatch, certificate is not valid for '127.0.0.1'"
    )
    assert type(outcome.error) is TlsError
    assert str(outcome.error) in expected(kind, "127.0.0.1", node.tls_port, reason)
    assert outcome.seconds < 10


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_a_server_hostname_the_certificate_does_not_name_fails(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(
        kind,
        node.tls_url(),
        ca_file=str(certificates.ca_file),
        server_hostname="broker.example",
    )
    reason = (
        "certificate verify failed: Hostname mismatch, certificate is not valid for "
        "'broker.example'"
    )
    where = f"localhost:{node.tls_port} (certificate name 'broker.example')"
    assert type(outcome.error) is TlsError
    allowed = {f"TLS failed: {where}: {reason}"}
    if kind == "sync":
        allowed.add(f"TLS failed: {reason}")
    assert str(outcome.error) in allowed
    assert outcome.seconds < 10


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_amqps_to_the_plain_port_fails(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    url = f"amqps://guest:guest@localhost:{node.port}/%2F"
    outcome = publish_one(kind, url, ca_file=str(certificates.ca_file))
    assert type(outcome.error) is TlsError
    assert str(outcome.error) in expected(kind, "localhost", node.port, NOT_TLS)
    assert outcome.seconds < 10


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_tls_verify_false_accepts_any_certificate_and_warns(
    kind: str,
    node: DisposableBroker,
    certificates: Certificates,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("WARNING", logger="reliable_amqp")
    outcome = publish_one(kind, node.tls_url("127.0.0.1"), tls_verify=False)
    assert outcome.error is None
    assert isinstance(outcome.confirmation, Confirmation)
    warnings = [r.getMessage() for r in caplog.records if "tls_verify=False" in r.getMessage()]
    assert warnings == [
        "reliable-amqp: tls_verify=False: the broker's certificate and host name are NOT "
        "verified; the connection is encrypted but anyone in the path can impersonate the broker"
    ]


def test_the_sync_tls_error_names_the_host(
    node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one("sync", node.tls_url(), ca_file=str(certificates.other_ca_file))
    assert str(outcome.error) == f"TLS failed: localhost:{node.tls_port}: {SELF_SIGNED}"


def test_the_cli_with_ca_file_and_insecure(
    node: DisposableBroker, certificates: Certificates
) -> None:
    import subprocess
    import sys

    def cli(*flags: str, url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "reliable_amqp",
                "publish",
                "--declare-queue",
                "tls-cli",
                *flags,
            ],
            input="one\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={"PATH": "/usr/bin:/bin", "AMQP_URL": url},
        )

    good = cli("--ca-file", str(certificates.ca_file), "-q", url=node.tls_url())
    assert (good.returncode, good.stderr) == (0, "")
    insecure = cli("--insecure", "-q", url=node.tls_url("127.0.0.1"))
    assert (insecure.returncode, insecure.stderr) == (0, "")
    refused = cli("--ca-file", str(certificates.other_ca_file), "-q", url=node.tls_url())
    assert refused.returncode == 3
    problem = (
        f"cannot connect to amqps://guest:***@localhost:{node.tls_port}/%2F: "
        f"TLS failed: localhost:{node.tls_port}: {SELF_SIGNED}"
    )
    # the error once; the message it left unsent is not told it again
    unsent = "1 message (line 1) not sent: no connection to the broker"
    assert refused.stderr == f"reliable-amqp: {problem}\n{unsent}\n"


def test_the_sync_consumer_reads_every_message_once_in_order_over_tls(
    node: DisposableBroker, certificates: Certificates
) -> None:
    """The sync consumer's socket is read 64 KiB at a time (pika's 4 KiB otherwise), TLS
    included: small messages many to a read, a body over several frames and reads, every one
    handled once, in order, and acked."""
    queue = "tls-consume"
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    connection.channel().queue_declare(queue, durable=True)
    connection.close()
    ids = [f"m-{n}" for n in range(3000)]
    bodies = {m: (m.encode() * (40_000 if n % 500 == 7 else 1)) for n, m in enumerate(ids)}
    with Publisher(node.url) as publisher:
        for message_id in ids:
            publisher.publish("", queue, bodies[message_id], message_id=message_id)
        assert publisher.flush(timeout=60) == 0
    seen: list[str] = []
    wrong: list[str] = []
    consumer = Consumer(node.tls_url(), queue, prefetch=300, ca_file=str(certificates.ca_file))

    def handler(delivery: Delivery) -> None:
        message_id = delivery.message_id or ""
        if delivery.body != bodies.get(message_id):
            wrong.append(message_id)
        seen.append(message_id)
        if len(seen) == len(ids):
            consumer.stop()

    give_up = threading.Timer(120, consumer.stop)  # a stuck consumer fails, not hangs
    give_up.start()
    try:
        with consumer:
            consumer.run(handler)
    finally:
        give_up.cancel()
    assert not wrong
    assert seen == ids
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    try:
        assert connection.channel().queue_declare(queue, passive=True).method.message_count == 0
    finally:
        connection.channel().queue_delete(queue)
        connection.close()
