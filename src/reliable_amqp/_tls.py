"""TLS for both publishers: the one ``ssl.SSLContext`` built from the options, and what a TLS
failure says.

The core has no I/O; reading certificate files is I/O, so the context is built here, once per
publisher, and handed to pika (``pika.SSLOptions``) or aio-pika (``ssl_context=``). Verification
of the certificate chain and of the host name is on unless ``tls_verify=False``, which is logged
as a warning every time a context is built with it.

:func:`tls_failure` recognises a TLS failure inside whatever a client library raised (pika wraps
it in its connection workflow errors, aiormq in ``AMQPConnectionError``), so that both adapters
report it as a :class:`~reliable_amqp.TlsError` instead of retrying it.
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Iterator
from urllib.parse import urlsplit

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.options import PublisherOptions

__all__ = ["client_context", "tls_failure", "uses_tls"]

log = logging.getLogger("reliable_amqp")

#: OpenSSL reasons of a failed handshake, in words a user can act on.
_REASONS = {
    "WRONG_VERSION_NUMBER": "the port does not speak TLS (is it the plain AMQP port, 5672?)",
    "UNEXPECTED_EOF_WHILE_READING": "the broker closed the connection during the TLS handshake",
    "RECORD_LAYER_FAILURE": "the port does not speak TLS (is it the plain AMQP port, 5672?)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the broker requires a client certificate (cert_file)",
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "the broker refused the handshake (a client certificate "
    "it wanted, or no cipher or TLS version in common)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the broker refused the client certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "the broker does not trust the client certificate's issuer",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the broker refused the client certificate",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common with the broker",
}


def uses_tls(url: str) -> bool:
    """True for an ``amqps://`` URL."""
    return urlsplit(url).scheme.lower() == "amqps"


def client_context(options: PublisherOptions) -> ssl.SSLContext | None:
    """The SSL context for the ``amqps://`` URLs of ``options`` (None when none uses TLS).

    ``ssl_context`` is used as it is (the options checked that it verifies); otherwise a context
    from ``ssl.create_default_context`` trusts ``ca_file`` (else the system's authorities) and
    presents ``cert_file``/``key_file`` when given. Raises :class:`ConfigurationError`, naming
    the option and the file, when a file cannot be read; a key password is never shown.
    """
    if not any(uses_tls(url) for url in options.urls):
        return None
    if options.ssl_context is not None:
        return options.ssl_context
    try:
        context = ssl.create_default_context(cafile=options.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"cannot load ca_file {options.ca_file!r}: {_file_problem(exc)}"
        ) from None
    if options.cert_file:
        try:
            context.load_cert_chain(
                options.cert_file, options.key_file, password=options.key_password
            )
        except (OSError, ssl.SSLError) as exc:
            key = f" with key_file {options.key_file!r}" if options.key_file else ""
            hint = " (or a wrong key_password)" if isinstance(exc, ssl.SSLError) else ""
            raise ConfigurationError(
                f"cannot load cert_file {options.cert_file!r}{key}: {_file_problem(exc)}{hint}"
            ) from None
    if not options.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        log.warning(
            "reliable-amqp: tls_verify=False: the broker's certificate and host name are NOT "
            "verified; the connection is encrypted but anyone in the path can impersonate "
            "the broker"
        )
    return context


def _file_problem(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"not a usable PEM file ({exc.reason or 'unreadable'})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


def tls_failure(error: BaseException | None) -> str | None:
    """What went wrong with TLS in ``error`` (or an exception it wraps), or None if nothing did.

    Looks through pika's workflow errors (``exceptions``, ``exception``) and exception causes.
    The text comes from the ``ssl`` exception's fields, never from a client library's message,
    which may hold a URL.
    """
    chain = list(_chain(error))
    for inner in chain:
        if isinstance(inner, ssl.SSLCertVerificationError):
            detail = str(inner.verify_message or inner.reason or "").rstrip(".")
            return f"certificate verify failed: {detail or 'untrusted certificate'}"
        if isinstance(inner, ssl.CertificateError):  # a host name check outside OpenSSL
            return f"certificate verify failed: {inner.args[0] if inner.args else ''}".rstrip()
        if isinstance(inner, ssl.SSLEOFError):
            return _REASONS["UNEXPECTED_EOF_WHILE_READING"]
        if isinstance(inner, ssl.SSLError):
            reason = str(inner.reason or "")
            return _REASONS.get(reason, f"TLS handshake failed ({reason or 'no reason given'})")
    for inner in chain:
        # pika reports an alert that arrives after the handshake (TLS 1.3: a client certificate
        # the broker wanted) as a lost stream whose message is the SSLError's text
        found = _SSL_TEXT.search(str(inner))
        if found is not None:
            reason = found.group(1)
            if reason == "CERTIFICATE_VERIFY_FAILED":
                return "certificate verify failed"
            return _REASONS.get(reason, f"TLS handshake failed ({reason})")
    return None


_SSL_TEXT = re.compile(r"\[SSL: ([A-Z0-9_]+)\]")


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend(getattr(current, "exceptions", None) or ())  # pika's workflow failure
        todo.append(getattr(current, "exception", None))  # pika's connector errors
        todo.append(current.__cause__)
        todo.append(current.__context__)
        todo.extend(arg for arg in current.args if isinstance(arg, BaseException))
