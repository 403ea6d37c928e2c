"""TLS test support: certificates made with trustme at test time, and a helper that connects a
publisher (sync or async) and reports what happened and how long it took.

Each test module starts its own disposable RabbitMQ node with a TLS listener (module scope: one
node start, about 5 s, per module).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trustme  # the dev extra has it: a missing one fails the run, it never skips it

from reliable_amqp import AsyncPublisher, Confirmation, Publisher

#: the name the broker's certificate is issued for; 127.0.0.1 is deliberately not in it
SERVER_NAME = "localhost"


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA the broker's certificate chains to, another CA, a client certificate."""

    ca_file: Path
    server_cert: Path
    server_key: Path
    other_ca_file: Path
    client_cert: Path
    client_key: Path


def make_certificates(folder: Path) -> Certificates:
    """A CA, a server certificate for ``localhost`` only, a client certificate, a stranger CA."""
    ca = trustme.CA()
    server = ca.issue_cert(SERVER_NAME)
    client = ca.issue_cert("reliable-amqp-client")
    files = Certificates(
        ca_file=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        other_ca_file=folder / "other-ca.pem",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
    )
    ca.cert_pem.write_to_path(str(files.ca_file))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    server.private_key_pem.write_to_path(str(files.server_key))
    trustme.CA().cert_pem.write_to_path(str(files.other_ca_file))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    return files


@dataclass
class Outcome:
    """What connecting and publishing one message gave, and after how many seconds."""

    confirmation: Confirmation | None
    error: BaseException | None
    seconds: float


PUBLISHERS = ("sync", "async")


def publish_one(kind: str, url: str, **options: Any) -> Outcome:
    """Connect a ``kind`` publisher, declare a queue, publish one message and wait for it."""
    options.setdefault("connect_timeout", 5.0)
    started = time.monotonic()
    try:
        if kind == "sync":
            confirmation = _publish_sync(url, options)
        else:
            confirmation = asyncio.run(asyncio.wait_for(_publish_async(url, options), 30))
    except Exception as exc:  # the test asserts on it
        return Outcome(None, exc, time.monotonic() - started)
    return Outcome(confirmation, None, time.monotonic() - started)


def _publish_sync(url: str, options: dict[str, Any]) -> Confirmation:
    with Publisher(url, **options) as publisher:
        queue = publisher.declare_queue("tls-test", durable=False, auto_delete=False)
        return publisher.publish_and_wait("", queue, b"over TLS")


async def _publish_async(url: str, options: dict[str, Any]) -> Confirmation:
    async with AsyncPublisher(url, **options) as publisher:
        queue = await publisher.declare_queue("tls-test", durable=False, auto_delete=False)
        return await publisher.publish_and_wait("", queue, b"over TLS")


def client_context(certificates: Certificates, *, with_client_cert: bool = False) -> ssl.SSLContext:
    """A verifying context that trusts the test CA (and presents the client certificate)."""
    context = ssl.create_default_context(cafile=str(certificates.ca_file))
    if with_client_cert:
        context.load_cert_chain(str(certificates.client_cert), str(certificates.client_key))
    return context
