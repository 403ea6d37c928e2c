"""Publisher options, validated once and shared by the sync and async publishers.

Everything a user can set on ``Publisher(url, **options)`` is a field of :class:`PublisherOptions`;
:meth:`PublisherOptions.from_strings` accepts the same options as strings (Spark options,
environment variables, command-line flags).
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.stats import PublisherEvent

if TYPE_CHECKING:
    import ssl

    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

#: Default connect/reconnect policy: quick first retries, bounded, about a minute in all.
DEFAULT_CONNECT_POLICY = RetryPolicy(
    max_attempts=20, initial_delay=0.1, max_delay=5.0, multiplier=2.0, jitter=0.2, deadline=60.0
)
#: With a spool: reconnect for as long as it takes (the spool holds what waits meanwhile).
SPOOL_CONNECT_POLICY = RetryPolicy(
    max_attempts=None, initial_delay=0.1, max_delay=5.0, multiplier=2.0, jitter=0.2, deadline=None
)
#: With a spool, ``delivery_timeout`` unless given: ten years, i.e. no deadline.
SPOOL_DELIVERY_TIMEOUT = 10 * 365 * 86400.0
#: The values of ``spool_fsync`` (see docs/spool.md).
SPOOL_FSYNC_POLICIES = ("commit", "persist", "never")
#: Default nack policy: a nack from a full queue (x-overflow=reject-publish) gets time to drain.
DEFAULT_NACK_POLICY = RetryPolicy(
    max_attempts=5, initial_delay=0.1, max_delay=2.0, multiplier=2.0, jitter=0.05
)


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (for reprs, logs and errors).

    RFC 3986 forbids a raw ``@``, ``/``, ``?`` or ``#`` in a password, but users write them, so
    where the user info ends is ambiguous and the answer always hides more:

    - when an ``@`` comes before the first ``/``, ``?`` or ``#`` there is user info, and it may
      run on to any later ``@``: everything from the first ``:`` up to the *last* ``@`` is hidden
      (``amqp://u:p@x/y@h/`` -> ``amqp://u:***@h/``), so no reading shows part of a password;
    - when no ``@`` comes before it, the text up to it is what a URL parser (and so the
      connection) takes as ``host[:port]``: if that is a valid one, an ``@`` further on is in the
      path, query or fragment and the URL has no password (``amqp://h:5672/v@x`` is shown as it
      is); if not (``amqp://u:p/w@h/``: ``p/w`` is no port), it is the start of a password
      holding ``/``, ``?`` or ``#``, hidden up to the last ``@``.
    """
    if not isinstance(url, str):
        return "<not a url>"
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    if at < 0:
        return _redact_query(url, len(url) - len(rest))
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" not in authority:
        # A valid host[:port] (port: ASCII digits) is what the connection uses, and then the
        # '@' is in the path, query or fragment, unless a ':' after the host and before the last
        # '@' could start a password (of a user name holding '/', '?' or '#').
        if authority.startswith("["):
            host_end = authority.find("]") + 1
            valid = host_end > 0 and "[" not in authority[1:host_end]
        else:
            host_end = authority.find(":")
            host_end = len(authority) if host_end < 0 else host_end
            valid = host_end > 0 and "[" not in authority[:host_end] and "]" not in authority
        port = authority[host_end + 1 :]
        if host_end < len(authority):
            valid = valid and authority[host_end] == ":" and port.isascii() and port.isdigit()
            valid = valid and len(port) <= 5 and int(port) < 65536
        first_colon = rest.find(":", host_end, at)
        if valid and (first_colon < 0 or first_colon == host_end < len(authority)):
            return _redact_query(url, len(url) - len(rest))
    user, colon, _password = rest[:at].partition(":")
    if not colon:
        # no ':' before the last '@': a user name at most, no password
        return _redact_query(url, len(url) - len(rest))
    head = f"{scheme}{sep}{user}:***@"
    return _redact_query(head + rest[at + 1 :], len(head))


#: Query parameters whose values :func:`redact_url` shows: ``heartbeat`` and the client
#: libraries' parameters that a publisher option replaces (``connection_attempts=3`` says what
#: was meant; only a password is secret there). Every other value is hidden: a TLS parameter may
#: hold one (pika's ``ssl_options`` carries a key password), and so may an unknown one.
_SHOWN_QUERY_VALUES = frozenset({"heartbeat"})


def _redact_query(url: str, authority_start: int) -> str:
    """``url`` with the value of each query parameter not in :data:`_SHOWN_QUERY_VALUES` or
    :data:`_PARAMETER_OPTIONS` replaced by ``***``."""
    tail = url[authority_start:]
    query_at = tail.find("?")
    fragment_at = tail.find("#")
    if query_at < 0 or 0 <= fragment_at < query_at:
        return url
    end = fragment_at if fragment_at > query_at else len(tail)
    pairs = []
    for pair in re.split("([&;])", tail[query_at + 1 : end]):
        key, equals, _value = pair.partition("=")
        name = unquote(key).strip().lower()
        hidden = equals and name not in _SHOWN_QUERY_VALUES and name not in _PARAMETER_OPTIONS
        pairs.append(f"{key}=***" if hidden else pair)
    return url[: authority_start + query_at + 1] + "".join(pairs) + tail[end:]


#: Written into errors about URLs that do not parse: the usual cause is a raw special character in
#: a password, and the parser's own message would quote a piece of it.
_ENCODE_HINT = (
    "a password holding '/', '?', '#', '@' or ':' must be percent-encoded "
    "(%2F, %3F, %23, %40, %3A), or given as the password option instead"
)

#: The only query parameter a broker URL may carry (both publishers honour it alike).
URL_PARAMETERS = frozenset({"heartbeat"})

#: Query parameters of pika or aiormq that configure TLS: refused, so that no URL can weaken
#: certificate or host name verification behind the options' back.
TLS_URL_PARAMETERS = frozenset(
    {
        "ssl_options",
        "cafile",
        "capath",
        "cadata",
        "ca_certs",
        "certfile",
        "keyfile",
        "cert_reqs",
        "no_verify_ssl",
        "verify_ssl",
        "ssl",
        "ssl_version",
        "server_hostname",
    }
)

#: Client-library query parameters that this library sets itself, and the option that does it.
_PARAMETER_OPTIONS = {
    "timeout": "connect_timeout",
    "socket_timeout": "connect_timeout",
    "stack_timeout": "connect_timeout",
    "connection_attempts": "connect_policy",
    "retry_delay": "connect_policy",
    "blocked_connection_timeout": "blocked_timeout",
    "name": "connection_name",
    "client_properties": "connection_name",
}

_PARAMETER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,39}")


def check_url(url: object) -> str:
    """Validate an AMQP URL; raise :class:`ConfigurationError` (password redacted) if malformed.

    Besides the scheme, host and port, the query may only hold ``heartbeat`` (see
    :func:`url_parameters`), and no raw ``@`` may follow the host: it would be either a password
    that was not percent-encoded or a vhost that reads like one.
    """
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"a broker URL must be a non-empty str, got {url!r}")
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        # never the parser's text: "Port could not be cast to integer value as 'Zq7'" quotes
        # the start of a password holding '/'
        problem = "invalid IPv6 address" if "IPv6" in str(exc) else "the port is not a number"
        raise ConfigurationError(
            f"malformed broker URL {shown}: {problem}; {_ENCODE_HINT}"
        ) from None
    if parts.scheme not in ("amqp", "amqps"):
        raise ConfigurationError(
            f"broker URL {shown} must start with amqp:// or amqps://, not {parts.scheme or '(none)'}://"
        )
    if not parts.hostname:
        raise ConfigurationError(f"broker URL {shown} has no host")
    if port is not None and not 0 < port < 65536:
        raise ConfigurationError(f"broker URL {shown} has an invalid port")
    after_host = url[url.index("//") + 2 + len(parts.netloc) :]
    if "@" in after_host:
        raise ConfigurationError(
            f"malformed broker URL {_hide_to_last_at(url)}: a raw '@' after the host; "
            f"{_ENCODE_HINT} (an '@' in a vhost is written %40)"
        )
    url_parameters(url)
    return url


def _hide_to_last_at(url: str) -> str:
    # everything between the first ':' after the scheme and the last '@': covers every reading
    scheme, sep, rest = url.partition("://")
    user, colon, _ = rest[: rest.rfind("@")].partition(":")
    return f"{scheme}{sep}{user}:***@{rest[rest.rfind('@') + 1 :]}" if colon else redact_url(url)


def url_parameters(url: str) -> dict[str, str]:
    """The query parameters of a broker URL, checked: only ``heartbeat`` is accepted.

    TLS parameters (pika's ``ssl_options``, aiormq's ``cafile``, ``no_verify_ssl``, ...) are
    refused, so that no URL can switch certificate verification off: use the ``ca_file``,
    ``cert_file``, ``key_file``, ``server_hostname`` and ``tls_verify`` options. Parameters that
    a publisher option sets (``timeout``, ``connection_attempts``, ``name``, ...) are refused
    naming that option. Values are never quoted in errors (they may be secrets).
    """
    query = urlsplit(url).query
    found: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        name = key.strip().lower()
        shown = repr(name) if _PARAMETER_NAME.fullmatch(name) else "(unreadable name)"
        where = f"broker URL {redact_url(url)}"
        if name in TLS_URL_PARAMETERS:
            raise ConfigurationError(
                f"{where}: the URL parameter {shown} configures TLS, which URLs may not do; use "
                "the publisher options ca_file, cert_file, key_file, key_password, "
                "server_hostname, tls_verify or ssl_context instead"
            )
        if name in _PARAMETER_OPTIONS:
            raise ConfigurationError(
                f"{where}: the URL parameter {shown} is not accepted; use the publisher option "
                f"{_PARAMETER_OPTIONS[name]} instead"
            )
        if name not in URL_PARAMETERS:
            raise ConfigurationError(
                f"{where}: unknown URL parameter {shown} (a URL may only carry heartbeat; "
                "everything else is a publisher option)"
            )
        if name in found:
            raise ConfigurationError(f"{where}: the URL parameter {shown} is given twice")
        found[name] = value
    return found


def url_heartbeat(url: str) -> int | None:
    """The ``?heartbeat=N`` of a broker URL (0 disables heartbeats), or None when it has none.

    Parsed from the query alone: a password or vhost holding the word ``heartbeat`` is no
    heartbeat setting.
    """
    raw = url_parameters(url).get("heartbeat")
    if raw is None:
        return None
    value = raw.strip()
    if not (value.isascii() and value.isdigit()) or not 0 <= int(value) <= 65535:
        raise ConfigurationError(
            f"broker URL {redact_url(url)}: heartbeat must be a whole number of seconds from 0 "
            "to 65535"
        )
    return int(value)


def vhost_of(url: str) -> str:
    """The virtual host an AMQP URL names (``/`` when the path is empty)."""
    path = urlsplit(url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def default_url(host: str = "127.0.0.1", port: int = 5672, vhost: str = "/") -> str:
    """``amqp://guest:guest@host:port/vhost`` with the vhost escaped."""
    return f"amqp://guest:guest@{host}:{port}/{quote(vhost, safe='')}"


@dataclass(frozen=True, slots=True)
class PublisherOptions:
    """Options of a publisher. Defaults are the safe ones: bounded window, bounded deadlines."""

    #: broker URLs, tried in turn (failover); passwords never appear in reprs
    urls: tuple[str, ...]
    #: at most this many unresolved messages; ``publish()`` waits while the window is full
    max_in_flight: int = 10_000
    #: at most this many body bytes unresolved (one larger message is let through alone)
    max_in_flight_bytes: int = 64 * 1024 * 1024
    #: how long ``publish()`` may wait for room in the window before raising PublishTimeout
    publish_timeout: float = 60.0
    #: a message's whole deadline, reconnects and retries included
    delivery_timeout: float = 120.0
    #: one connection attempt (TCP + AMQP handshake) may take this long
    connect_timeout: float = 10.0
    #: AMQP heartbeat in seconds (0 disables it). A link with no byte from the broker for two
    #: heartbeats is taken as dead: with 5, a frozen node is left within 10 to 15 s
    #: (docs/brokers.md#a-frozen-node)
    heartbeat: int = 5
    #: how ``close()`` waits for outstanding confirms when no timeout is given
    close_timeout: float = 30.0
    #: a sync ``Publisher`` still open when the interpreter exits is closed then, waiting this
    #: long for outstanding confirms (what is left is reported: docs/contract.md)
    exit_timeout: float = 10.0
    #: the default of ``publish(mandatory=...)``: True makes a message that no queue takes fail
    #: with MessageReturned; False lets the broker confirm and drop it
    mandatory: bool = True
    #: seconds a ``connection.blocked`` may last before the connection is dropped and recovered
    #: (None: wait as long as deadlines allow)
    blocked_timeout: float | None = None
    #: reconnect policy (also governs the first connection)
    connect_policy: RetryPolicy = DEFAULT_CONNECT_POLICY
    #: how nacked messages are retried
    nack_policy: RetryPolicy = DEFAULT_NACK_POLICY
    #: header to stamp with the stable message id (LavinMQ's ``x-deduplication-header``)
    dedup_header: str | None = None
    #: connection name shown in the broker's management UI
    connection_name: str | None = None
    #: called with a PublisherEvent on connect, loss, recovery, block, ... (keep it quick: it
    #: runs on the publisher's I/O thread or event loop; exceptions are logged and ignored)
    on_event: Callable[[PublisherEvent], None] | None = None
    #: user name for every URL, instead of the one in the URL
    username: str | None = None
    #: password for every URL, instead of the one in the URL (never shown in reprs, logs, errors)
    password: str | None = None
    #: TLS (``amqps://`` URLs): a ready ``ssl.SSLContext``, used as it is (instead of the file
    #: options below; it must verify certificates and host names unless ``tls_verify=False``)
    ssl_context: ssl.SSLContext | None = None
    #: PEM file of the certificate authorities to trust (default: the system's)
    ca_file: str | None = None
    #: PEM file of the client certificate, for brokers that ask for one (mutual TLS)
    cert_file: str | None = None
    #: PEM file of the client certificate's private key (default: inside ``cert_file``)
    key_file: str | None = None
    #: password of an encrypted ``key_file`` (never shown)
    key_password: str | None = None
    #: the name the broker's certificate must carry (default: the URL's host)
    server_hostname: str | None = None
    #: verify the broker's certificate chain and host name; False (logged as a warning) accepts
    #: any certificate: encryption without authentication
    tls_verify: bool = True
    #: durable spool directory (docs/spool.md): ``publish()`` appends each message to it and the
    #: broker's confirm removes it, so a crash of the process or a long broker outage loses
    #: nothing; None: unconfirmed messages live in memory only
    spool: str | None = None
    #: bytes of messages the spool may hold; beyond it ``publish()`` waits for room, then raises
    #: PublishTimeout after ``publish_timeout``
    spool_max_bytes: int = 1024**3
    #: when the spool's writes are forced to disk: "commit" (every batch the writer commits),
    #: "persist" (at ``persist()`` and ``close()``) or "never" (docs/spool.md#what-is-guaranteed)
    spool_fsync: str = "persist"
    #: OpenTelemetry ``TracerProvider`` for this publisher's PRODUCER spans, instead of the
    #: global one (needs the ``otel`` extra; see docs/observability.md)
    tracer_provider: TracerProvider | None = None
    #: OpenTelemetry ``MeterProvider`` for this publisher's metrics, instead of the global one
    meter_provider: MeterProvider | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigurationError("at least one broker URL is needed")
        for url in self.urls:
            check_url(url)
            heartbeat = url_heartbeat(url)
            if heartbeat is not None and heartbeat != self.heartbeat:
                raise ConfigurationError(
                    f"broker URL {redact_url(url)} says heartbeat={heartbeat} but the heartbeat "
                    f"option is {self.heartbeat!r}: give it once"
                )
        self._check_credentials_and_tls()
        _positive_int("max_in_flight", self.max_in_flight)
        _positive_int("max_in_flight_bytes", self.max_in_flight_bytes)
        for name in _FLOAT_OPTIONS:
            _positive_float(name, getattr(self, name))
        if self.blocked_timeout is not None:
            _positive_float("blocked_timeout", self.blocked_timeout)
        if (
            not isinstance(self.heartbeat, int)
            or isinstance(self.heartbeat, bool)
            or not (0 <= self.heartbeat <= 65535)
        ):
            raise ConfigurationError(
                f"heartbeat must be an int from 0 to 65535, got {self.heartbeat!r}"
            )
        for name in ("connect_policy", "nack_policy"):
            if not isinstance(getattr(self, name), RetryPolicy):
                raise ConfigurationError(f"{name} must be a RetryPolicy")
        if self.on_event is not None and not callable(self.on_event):
            raise ConfigurationError("on_event must be callable")
        self._check_spool()
        for name, method in (("tracer_provider", "get_tracer"), ("meter_provider", "get_meter")):
            provider = getattr(self, name)
            if provider is not None and not callable(getattr(provider, method, None)):
                raise ConfigurationError(
                    f"{name} must be an OpenTelemetry provider (with {method}()), "
                    f"got {type(provider).__name__}"
                )

    def _check_spool(self) -> None:
        if self.spool is not None and (not isinstance(self.spool, str) or not self.spool):
            raise ConfigurationError(
                f"spool must be a directory path (str) or None, got {self.spool!r}"
            )
        _positive_int("spool_max_bytes", self.spool_max_bytes)
        if self.spool_fsync not in SPOOL_FSYNC_POLICIES:
            raise ConfigurationError(
                f"spool_fsync must be one of {', '.join(SPOOL_FSYNC_POLICIES)}, "
                f"got {self.spool_fsync!r}"
            )

    def _check_credentials_and_tls(self) -> None:
        for name in _CREDENTIAL_AND_TLS_STRINGS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                shown = type(value).__name__ if name in _SECRET_OPTIONS else repr(value)
                raise ConfigurationError(f"{name} must be a str or None, got {shown}")
        if self.username == "":
            raise ConfigurationError("username must not be empty (None: the URL's)")
        for name in _BOOL_OPTIONS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.server_hostname == "":
            raise ConfigurationError("server_hostname must not be empty (None: the URL's host)")
        files = [
            n for n in ("ca_file", "cert_file", "key_file", "key_password") if getattr(self, n)
        ]
        context = self.ssl_context
        if context is not None:
            ssl_module = sys.modules.get("ssl")  # loaded by whoever built the context
            if ssl_module is None or not isinstance(context, ssl_module.SSLContext):
                raise ConfigurationError(
                    f"ssl_context must be an ssl.SSLContext, got {type(context).__name__}"
                )
            if files:
                raise ConfigurationError(
                    f"give either ssl_context or {', '.join(files)}: the files go into the "
                    "context you build (load_verify_locations, load_cert_chain)"
                )
            if not self.tls_verify:
                raise ConfigurationError(
                    "tls_verify=False does not change an ssl_context you built: set its "
                    "check_hostname=False and verify_mode=ssl.CERT_NONE yourself"
                )
            if context.verify_mode != ssl_module.CERT_REQUIRED or not context.check_hostname:
                raise ConfigurationError(
                    "the ssl_context does not verify the broker's certificate and host name "
                    "(verify_mode CERT_REQUIRED and check_hostname True): build it with "
                    "ssl.create_default_context()"
                )
        if (self.key_file or self.key_password) and not self.cert_file:
            raise ConfigurationError("key_file and key_password need cert_file (the certificate)")
        tls_options = [
            *files,
            *(["ssl_context"] if context is not None else []),
            *(["server_hostname"] if self.server_hostname else []),
            *(["tls_verify=False"] if not self.tls_verify else []),
        ]
        if tls_options and not any(u.lower().startswith("amqps://") for u in self.urls):
            raise ConfigurationError(
                f"{', '.join(tls_options)} set but no broker URL uses TLS: write amqps://"
            )

    def __repr__(self) -> str:
        shown = ", ".join(redact_url(u) for u in self.urls)
        return f"PublisherOptions(urls=[{shown}], max_in_flight={self.max_in_flight}, ...)"

    def login(self, url: str) -> tuple[str, str]:
        """The user and password a connection to ``url`` logs in with: the ``username`` and
        ``password`` options where given, else the URL's, else ``guest`` (as pika and aiormq
        default)."""
        parts = urlsplit(url)
        user = self.username or unquote(parts.username or "") or "guest"
        if self.password is not None:
            return user, self.password
        return user, unquote(parts.password or "") or "guest"

    def kwargs(self) -> dict[str, Any]:
        """The keyword options that rebuild these: ``Publisher(list(o.urls), **o.kwargs())``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "urls"}

    @classmethod
    def create(cls, url: str | Sequence[str], **options: Any) -> PublisherOptions:
        """Options from a URL (or list of URLs) and keyword options; policies may be dicts."""
        urls = (url,) if isinstance(url, str) else tuple(url)
        known = {f.name for f in fields(cls)} - {"urls"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown publisher option {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        for name in ("connect_policy", "nack_policy"):
            if name in options and not isinstance(options[name], RetryPolicy):
                options[name] = RetryPolicy.from_dict(options[name], base=_DEFAULT_POLICIES[name])
        if options.get("spool") is not None:
            if isinstance(options["spool"], os.PathLike):
                options["spool"] = os.fspath(options["spool"])
            # a spooled message waits for the broker as long as it takes (the spool bounds it,
            # not a clock), and the publisher keeps reconnecting: unless told otherwise
            options.setdefault("delivery_timeout", SPOOL_DELIVERY_TIMEOUT)
            options.setdefault("connect_policy", SPOOL_CONNECT_POLICY)
        if "heartbeat" not in options:
            # ?heartbeat=N in the URLs is the heartbeat option (the liveness check reads it)
            given = {_url_heartbeat_or_none(u) for u in urls if isinstance(u, str)} - {None}
            if len(given) > 1:
                raise ConfigurationError(
                    "the broker URLs give different heartbeats: set the heartbeat option instead"
                )
            if given:
                options["heartbeat"] = given.pop()
        return cls(urls=urls, **options)

    @classmethod
    def from_strings(cls, url: str | Sequence[str], options: Mapping[str, str]) -> PublisherOptions:
        """Options given as strings: ``"max_in_flight": "1000"``, ``"nack_policy.max_attempts":
        "3"`` (dotted keys build policies), ``"connect_policy": "{json}"`` is not accepted."""
        typed: dict[str, Any] = {}
        policies: dict[str, dict[str, str]] = {}
        for key, raw in options.items():
            name, _, sub = key.partition(".")
            if name in ("connect_policy", "nack_policy"):
                if not sub:
                    raise ConfigurationError(
                        f"set {name} as {name}.<field>, e.g. {name}.max_attempts"
                    )
                policies.setdefault(name, {})[sub] = raw
            elif name in _INT_OPTIONS:
                typed[name] = _parse_int(name, raw)
            elif name in _FLOAT_OPTIONS:
                typed[name] = _parse_float(name, raw)
            elif name == "blocked_timeout":
                typed[name] = (
                    None if raw.strip().lower() in ("", "none") else _parse_float(name, raw)
                )
            elif name in _STRING_OPTIONS:
                typed[name] = raw or None
            elif name in _BOOL_OPTIONS:
                typed[name] = _parse_bool(name, raw)
            elif name == "ssl_context":
                raise ConfigurationError(
                    "ssl_context cannot be given as a string: use ca_file, cert_file, key_file, "
                    "key_password and server_hostname"
                )
            elif name in ("tracer_provider", "meter_provider"):
                raise ConfigurationError(
                    f"{name} cannot be given as a string: configure OpenTelemetry's global "
                    "providers in the process that publishes (see docs/observability.md)"
                )
            else:
                typed[name] = raw  # create() names the unknown option
        for name, config in policies.items():
            typed[name] = RetryPolicy.from_dict(config, base=_DEFAULT_POLICIES[name])
        return cls.create(url, **typed)


def _url_heartbeat_or_none(url: str) -> int | None:
    try:
        return url_heartbeat(url)
    except ConfigurationError:
        return None  # __post_init__ reports the URL


_DEFAULT_POLICIES = {"connect_policy": DEFAULT_CONNECT_POLICY, "nack_policy": DEFAULT_NACK_POLICY}
#: options whose values are secrets: never quoted in an error
_SECRET_OPTIONS = frozenset({"password", "key_password"})
#: string options given as strings (an empty one means unset)
_CREDENTIAL_AND_TLS_STRINGS = (
    "username",
    "password",
    "ca_file",
    "cert_file",
    "key_file",
    "key_password",
    "server_hostname",
)
_STRING_OPTIONS = frozenset(
    {"dedup_header", "connection_name", "spool", "spool_fsync", *_CREDENTIAL_AND_TLS_STRINGS}
)
_INT_OPTIONS = {"max_in_flight", "max_in_flight_bytes", "heartbeat", "spool_max_bytes"}
_FLOAT_OPTIONS = (
    "publish_timeout",
    "delivery_timeout",
    "connect_timeout",
    "close_timeout",
    "exit_timeout",
)
_BOOL_OPTIONS = ("tls_verify", "mandatory")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{name} must be a whole number, got {raw!r}") from None


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ConfigurationError(f"{name} must be true or false, got {raw!r}")


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigurationError(f"{name} must be a whole number >= 1, got {value!r}")


def _positive_float(name: str, value: object) -> None:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(f"{name} must be a number of seconds > 0, got {value!r}")
