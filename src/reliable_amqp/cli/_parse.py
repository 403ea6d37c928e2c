"""The argument parser of ``reliable-amqp`` and the translation of flags into publisher options.

Every publisher option can come from a flag or, when the flag is absent, from an environment
variable (``AMQP_URL`` for the broker, ``RELIABLE_AMQP_<FLAG>`` for the rest), and anything else
:class:`~reliable_amqp.PublisherOptions` knows can be set with ``-o key=value``. Credentials can
stay off the command line: ``AMQP_USERNAME``, ``AMQP_PASSWORD`` and ``--password-file``.
"""

from __future__ import annotations

import argparse
import os
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reliable_amqp._core.errors import ConfigurationError
from reliable_amqp._core.options import (
    DEFAULT_CONNECT_POLICY,
    DEFAULT_NACK_POLICY,
    PublisherOptions,
    default_url,
)
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._version import __version__

#: Exit codes (documented in ``docs/cli.md``).
EXIT_OK = 0
EXIT_NOT_CONFIRMED = 1
EXIT_USAGE = 2
EXIT_CONNECTION = 3
EXIT_INTERRUPTED = 130

DEFAULT_URL = default_url()
ENV_PREFIX = "RELIABLE_AMQP_"
# as shown in --help: no password, and "%" escaped for argparse
_SHOWN_DEFAULT_URL = DEFAULT_URL.replace("guest:guest", "guest:***").replace("%", "%%")

EPILOG = """\
exit codes:
  0    every message was confirmed by the broker
  1    some messages were not confirmed (nacked, returned, rejected, timed out)
  2    bad arguments or bad input: nothing was published
  3    the broker could not be reached, or the connection was lost for good
  130  interrupted (Ctrl-C)
With --failed PATH, every message that was not confirmed is written to PATH (JSON lines that
`reliable-amqp publish --format jsonl PATH` publishes again with the same message ids).
"""

# The top-level --help's (EPILOG above is publish's): what the codes mean for every command.
COMMANDS_EPILOG = """\
exit codes, for every command:
  0    done: everything asked for went through
  1    not everything did (messages not confirmed, failed rows or dead letters left, damage
       found, a worker's processes kept dying); the command says which
  2    bad arguments or bad input: nothing was done
  3    the broker, or the outbox's database, could not be reached
  130  interrupted (Ctrl-C)
`reliable-amqp COMMAND --help` shows a command's flags (and for publish, what --failed keeps).
"""


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def count_at_least_one(text: str) -> int:
    """argparse type: a whole number >= 1."""
    value = count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


@dataclass(frozen=True)
class _Tuning:
    """A flag that sets one publisher option (or one field of a retry policy)."""

    flag: str
    dest: str
    parse: Callable[[str], int | float]
    option: str  # key for PublisherOptions.from_strings
    help: str
    offset: int = 0  # added to the value (retries -> attempts)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


TUNING: tuple[_Tuning, ...] = (
    _Tuning(
        "--nack-retries",
        "nack_retries",
        count,
        "nack_policy.max_attempts",
        "how often a nacked message is sent again before it fails "
        f"(default {(DEFAULT_NACK_POLICY.max_attempts or 1) - 1})",
        offset=1,
    ),
    _Tuning(
        "--retry-initial-delay",
        "retry_initial_delay",
        seconds,
        "nack_policy.initial_delay",
        f"seconds before the first retry of a nacked message "
        f"(default {DEFAULT_NACK_POLICY.initial_delay:g}); the wait doubles each time",
    ),
    _Tuning(
        "--retry-max-delay",
        "retry_max_delay",
        seconds,
        "nack_policy.max_delay",
        f"longest wait between retries of a nacked message "
        f"(default {DEFAULT_NACK_POLICY.max_delay:g})",
    ),
    _Tuning(
        "--delivery-timeout",
        "delivery_timeout",
        seconds,
        "delivery_timeout",
        "a message's whole deadline in seconds, retries and reconnects included (default "
        f"{PublisherOptions.__dataclass_fields__['delivery_timeout'].default:g})",
    ),
    _Tuning(
        "--connect-retries",
        "connect_retries",
        count,
        "connect_policy.max_attempts",
        "how often to try connecting again after a failed attempt or a lost connection "
        f"(default {(DEFAULT_CONNECT_POLICY.max_attempts or 1) - 1}, "
        f"within {DEFAULT_CONNECT_POLICY.deadline or 0:g} s)",
        offset=1,
    ),
    _Tuning(
        "--connect-timeout",
        "connect_timeout",
        seconds,
        "connect_timeout",
        "seconds one connection attempt may take (default "
        f"{PublisherOptions.__dataclass_fields__['connect_timeout'].default:g})",
    ),
    _Tuning(
        "--max-in-flight",
        "max_in_flight",
        count_at_least_one,
        "max_in_flight",
        "at most this many messages unconfirmed at once (default "
        f"{PublisherOptions.__dataclass_fields__['max_in_flight'].default})",
    ),
)


def _env_default(tuning: _Tuning) -> str | None:
    return os.environ.get(tuning.env) or None


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url`` (repeatable, for failover), the tuning flags and ``-o key=value``."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the library's log: reconnects and channel closes (-vv: debug)",
    )
    group = parser.add_argument_group("broker and publisher options")
    group.add_argument(
        "--url",
        action="append",
        metavar="URL",
        help="broker URL, repeat for failover (default: $AMQP_URL, else "
        f"{_SHOWN_DEFAULT_URL}); prefer $AMQP_URL for real "
        "passwords, which other users can see on a command line",
    )
    for tuning in TUNING:
        group.add_argument(
            tuning.flag,
            dest=tuning.dest,
            type=tuning.parse,
            default=_env_default(tuning),
            metavar="N" if tuning.parse is not seconds else "SECONDS",
            help=f"{tuning.help} [env {tuning.env}]",
        )
    group.add_argument(
        "-o",
        "--option",
        dest="options",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="any other publisher option, e.g. -o publish_timeout=30, "
        "-o nack_policy.jitter=0, -o dedup_header=x-deduplication-header",
    )
    add_tls_and_credential_arguments(group)


def add_tls_and_credential_arguments(group: argparse._ArgumentGroup) -> None:
    """``--ca-file``, ``--cert-file``, ``--key-file``, ``--insecure``, ``--password-file``."""
    group.add_argument(
        "--ca-file",
        metavar="PEM",
        default=os.environ.get(ENV_PREFIX + "CA_FILE") or None,
        help="trust the certificate authorities in PEM (amqps:// URLs; default: the system's) "
        f"[env {ENV_PREFIX}CA_FILE]",
    )
    group.add_argument(
        "--cert-file",
        metavar="PEM",
        default=os.environ.get(ENV_PREFIX + "CERT_FILE") or None,
        help="client certificate, for brokers that ask for one (mutual TLS) "
        f"[env {ENV_PREFIX}CERT_FILE]",
    )
    group.add_argument(
        "--key-file",
        metavar="PEM",
        default=os.environ.get(ENV_PREFIX + "KEY_FILE") or None,
        help=f"private key of --cert-file (default: inside it) [env {ENV_PREFIX}KEY_FILE]",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="do NOT verify the broker's TLS certificate and host name (encrypted, but anyone "
        "in the path can impersonate the broker)",
    )
    group.add_argument(
        "--password-file",
        metavar="PATH",
        help="read the broker password from PATH (its first line); else $AMQP_PASSWORD, else "
        "the URL's. The user name: $AMQP_USERNAME, else the URL's",
    )


def read_password_file(path: str) -> str:
    """The first line of ``path`` (without its line ending); UsageError if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as stream:
            first = stream.readline()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise UsageError(f"cannot read --password-file {path}: {reason}") from None
    password = first.rstrip("\r\n")
    if not password:
        raise UsageError(f"--password-file {path} is empty")
    return password


def printable(text: object) -> str:
    """``text`` with control characters escaped (``\\x1b``): what a broker sends (reply texts)
    or an error quotes must not drive the terminal."""
    out = []
    for char in str(text):
        if char.isprintable() or unicodedata.category(char) == "Zs":  # spaces are harmless
            out.append(char)
        else:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)


def urls_from_args(args: argparse.Namespace) -> list[str]:
    """The broker URLs: ``--url`` flags, else ``$AMQP_URL``, else the local default."""
    given: list[str] | None = args.url
    if given:
        return given
    return [os.environ.get("AMQP_URL") or DEFAULT_URL]


def publisher_options(args: argparse.Namespace) -> PublisherOptions:
    """Validated publisher options from the parsed flags; raises ConfigurationError."""
    strings: dict[str, str] = {}
    for key, value in args.options:
        strings[key] = value
    for tuning in TUNING:
        value = getattr(args, tuning.dest)
        if value is not None:
            strings[tuning.option] = str(value + tuning.offset)
    for name, default in (
        ("nack_policy", DEFAULT_NACK_POLICY),
        ("connect_policy", DEFAULT_CONNECT_POLICY),
    ):
        _complete_policy(strings, name, default)
    if getattr(args, "spool", None):
        strings["spool"] = args.spool
        # a command gives up on an unreachable broker as without a spool (what is left stays
        # there for the next run), unless told otherwise
        if not any(key.startswith("connect_policy") for key in strings):
            for field, value in DEFAULT_CONNECT_POLICY.to_dict().items():
                strings[f"connect_policy.{field}"] = "none" if value is None else str(value)
    for flag, option in (
        ("ca_file", "ca_file"),
        ("cert_file", "cert_file"),
        ("key_file", "key_file"),
    ):
        value = getattr(args, flag, None)
        if value:
            strings[option] = value
    if getattr(args, "insecure", False):
        strings["tls_verify"] = "false"
    if os.environ.get("AMQP_USERNAME"):
        strings.setdefault("username", os.environ["AMQP_USERNAME"])
    password_file = getattr(args, "password_file", None)
    if password_file:
        strings["password"] = read_password_file(password_file)
    elif os.environ.get("AMQP_PASSWORD"):
        strings.setdefault("password", os.environ["AMQP_PASSWORD"])
    return PublisherOptions.from_strings(urls_from_args(args), strings)


def _complete_policy(strings: dict[str, str], name: str, default: RetryPolicy) -> None:
    """Fill the fields of a partly given policy from the library's default for it.

    ``RetryPolicy.from_dict`` starts from ``RetryPolicy()``; a flag that changes one field of the
    nack policy must not silently change the others. kombu-style keys are left alone.
    """
    given = {key.partition(".")[2] for key in strings if key.startswith(name + ".")}
    if not given or given & {"max_retries", "interval_start", "interval_step", "interval_max"}:
        return
    for field, value in default.to_dict().items():
        strings.setdefault(f"{name}.{field}", "none" if value is None else str(value))


def check_options(args: argparse.Namespace) -> PublisherOptions:
    """Like :func:`publisher_options`, but a bad value is reported as a usage error (naming
    the command's flag where the library names a publisher option a flag sets)."""
    try:
        return publisher_options(args)
    except ConfigurationError as exc:
        raise UsageError(in_flags(printable(exc))) from None


def in_flags(text: str) -> str:
    """``text`` (an error of the library's) pointing at the command's flags: "use the publisher
    option connect_policy instead" becomes "use --connect-retries instead"."""
    for option, flags in _OPTION_FLAGS.items():
        text = text.replace(
            f"use the publisher option {option} instead",
            f"use {' or '.join(flags)} instead",
        )
    return text


#: the flags that set (part of) each publisher option
_OPTION_FLAGS: dict[str, list[str]] = {}
for _tuning in TUNING:
    _OPTION_FLAGS.setdefault(_tuning.option.partition(".")[0], []).append(_tuning.flag)


class UsageError(Exception):
    """Bad arguments or bad input: reported on stderr, exit code 2, nothing published."""


def build_parser(
    add_publish: Callable[[argparse.ArgumentParser], None],
    add_bench: Callable[[argparse.ArgumentParser], None],
    add_spool: Callable[[argparse.ArgumentParser], None] | None = None,
    add_outbox: Callable[[argparse.ArgumentParser], None] | None = None,
    more: Sequence[tuple[str, str, str, Callable[[argparse.ArgumentParser], None]]] = (),
) -> argparse.ArgumentParser:
    """The top-level parser with its ``publish``, ``bench``, ``spool`` and ``outbox``
    sub-commands, and ``more`` of them: ``(name, help, description, add_arguments)``."""
    parser = argparse.ArgumentParser(
        prog="reliable-amqp",
        description="Publish to RabbitMQ/LavinMQ with publisher confirms, losing nothing.",
        epilog=COMMANDS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    publish = sub.add_parser(
        "publish",
        help="publish messages from a file or stdin, each confirmed by the broker",
        description="Publish one message per input line (or per JSON line with --format jsonl).\n"
        "The whole input is read and checked before anything is sent.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_publish(publish)
    bench = sub.add_parser(
        "bench",
        help="compare transactions, per-message confirms, streaming confirms and no confirms",
        description="Measure, on your own broker, how fast each way of publishing is.\n"
        "Declares a durable queue of its own and deletes it afterwards.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench(bench)
    if add_spool is not None:
        spool = sub.add_parser(
            "spool",
            help="show what a publisher's spool directory holds; export or drop failed messages",
            description="Pending and failed messages of a spool (Publisher(spool=DIR)), counted\n"
            "and sized. Works while a publisher has the spool open.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_spool(spool)
    if add_outbox is not None:
        outbox = sub.add_parser(
            "outbox",
            help="the transactional outbox: init, relay, status, failed",
            description="Messages written in your database transactions (reliable_amqp.outbox),\n"
            "published by a relay once committed. See docs/outbox.md.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_outbox(outbox)
    for name, short, description, add in more:
        add(
            sub.add_parser(
                name,
                help=short,
                description=description,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return parser
