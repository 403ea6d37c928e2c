"""Publisher options, validated once and shared by the sync and async publishers.

Everything a user can set on ``Publisher(url, **options)`` is a field of :class:`PublisherOptions`;
:meth:`PublisherOptions.from_strings` accepts the same options as strings (Spark options,
environment variables, command-line flags).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.stats import PublisherEvent

#: Default connect/reconnect policy: quick first retries, bounded, about a minute in all.
DEFAULT_CONNECT_POLICY = RetryPolicy(
    max_attempts=20, initial_delay=0.1, max_delay=5.0, multiplier=2.0, jitter=0.2, deadline=60.0
)
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
        return url
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
            return url
    user, colon, _password = rest[:at].partition(":")
    if not colon:
        return url  # no ':' before the last '@': a user name at most, no password
    return f"{scheme}{sep}{user}:***@{rest[at + 1 :]}"


def check_url(url: object) -> str:
    """Validate an AMQP URL; raise :class:`ConfigurationError` (password redacted) if malformed."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"a broker URL must be a non-empty str, got {url!r}")
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"malformed broker URL {shown}: {exc}") from None
    if parts.scheme not in ("amqp", "amqps"):
        raise ConfigurationError(
            f"broker URL {shown} must start with amqp:// or amqps://, not {parts.scheme or '(none)'}://"
        )
    if not parts.hostname:
        raise ConfigurationError(f"broker URL {shown} has no host")
    if port is not None and not 0 < port < 65536:
        raise ConfigurationError(f"broker URL {shown} has an invalid port")
    return url


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
    #: AMQP heartbeat in seconds (0 disables it; a stalled link is noticed after about 2x this)
    heartbeat: int = 30
    #: how ``close()`` waits for outstanding confirms when no timeout is given
    close_timeout: float = 30.0
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

    def __post_init__(self) -> None:
        if not self.urls:
            raise ConfigurationError("at least one broker URL is needed")
        for url in self.urls:
            check_url(url)
        _positive_int("max_in_flight", self.max_in_flight)
        _positive_int("max_in_flight_bytes", self.max_in_flight_bytes)
        for name in ("publish_timeout", "delivery_timeout", "connect_timeout", "close_timeout"):
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

    def __repr__(self) -> str:
        shown = ", ".join(redact_url(u) for u in self.urls)
        return f"PublisherOptions(urls=[{shown}], max_in_flight={self.max_in_flight}, ...)"

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
            elif name in ("dedup_header", "connection_name"):
                typed[name] = raw or None
            else:
                typed[name] = raw  # create() names the unknown option
        for name, config in policies.items():
            typed[name] = RetryPolicy.from_dict(config, base=_DEFAULT_POLICIES[name])
        return cls.create(url, **typed)


_DEFAULT_POLICIES = {"connect_policy": DEFAULT_CONNECT_POLICY, "nack_policy": DEFAULT_NACK_POLICY}
_INT_OPTIONS = {"max_in_flight", "max_in_flight_bytes", "heartbeat"}
_FLOAT_OPTIONS = {
    "publish_timeout",
    "delivery_timeout",
    "connect_timeout",
    "close_timeout",
}


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{name} must be a whole number, got {raw!r}") from None


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
