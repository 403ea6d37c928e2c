"""Mutual TLS: a node that asks for a client certificate and refuses clients without one.

With TLS 1.3 the broker's refusal comes as an alert after the client's side of the handshake is
done; when the connection reset overtakes that alert, the attempt reads as a lost connection and
is retried once or twice (0.1 s apart) before the alert is seen: still a TlsError within 10 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.node import DisposableBroker, TlsListener
from reliable_amqp import Confirmation, TlsError
from support.tls import PUBLISHERS, Certificates, client_context, publish_one

pytestmark = [
    pytest.mark.broker,
    pytest.mark.rabbitmq_only(reason="a disposable RabbitMQ node of its own, with a TLS listener"),
]

CERTIFICATE_REQUIRED = "the broker requires a client certificate (cert_file)"


@pytest.fixture(scope="module")
def node(certificates: Certificates) -> Iterator[DisposableBroker]:
    """One node per module, with ``verify_peer`` and ``fail_if_no_peer_cert``."""
    tls = TlsListener(
        certificates.ca_file, certificates.server_cert, certificates.server_key, verify_peer=True
    )
    with DisposableBroker(tls=tls) as broker:
        yield broker


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_a_client_certificate_from_files_confirms(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(
        kind,
        node.tls_url(),
        ca_file=str(certificates.ca_file),
        cert_file=str(certificates.client_cert),
        key_file=str(certificates.client_key),
    )
    assert outcome.error is None
    assert isinstance(outcome.confirmation, Confirmation)


@pytest.mark.parametrize("kind", PUBLISHERS)
def test_a_client_certificate_in_an_ssl_context_confirms(
    kind: str, node: DisposableBroker, certificates: Certificates
) -> None:
    context = client_context(certificates, with_client_cert=True)
    outcome = publish_one(kind, node.tls_url(), ssl_context=context)
    assert outcome.error is None
    assert isinstance(outcome.confirmation, Confirmation)


@pytest.mark.parametrize("kind", PUBLISHERS)
@pytest.mark.parametrize("attempt", range(3))  # the alert races the reset: try a few times
def test_without_a_client_certificate_it_fails(
    kind: str, attempt: int, node: DisposableBroker, certificates: Certificates
) -> None:
    outcome = publish_one(kind, node.tls_url(), ca_file=str(certificates.ca_file))
    assert type(outcome.error) is TlsError
    allowed = {f"TLS failed: localhost:{node.tls_port}: {CERTIFICATE_REQUIRED}"}
    if kind == "sync":  # until _io passes the connection's parameters (see test_tls.py)
        allowed.add(f"TLS failed: {CERTIFICATE_REQUIRED}")
    assert str(outcome.error) in allowed
    assert outcome.seconds < 10
