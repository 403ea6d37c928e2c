"""Unit tests of ``_core/options.py``: PublisherOptions, URL checks and redaction.

Some tests pin down a bug found while writing them (fixed in 8ee60dd): passwords shown in
errors about malformed URLs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from reliable_amqp._core.errors import (
    ConfigurationError,
)
from reliable_amqp._core.options import (
    DEFAULT_CONNECT_POLICY,
    DEFAULT_NACK_POLICY,
    PublisherOptions,
    check_url,
    default_url,
    redact_url,
    url_heartbeat,
    vhost_of,
)
from reliable_amqp._core.policy import RetryPolicy
from reliable_amqp._core.stats import PublisherEvent
from support.broker import AMQP_DEFAULT_PORT as PORT

PASSWORD = "s3cretPW"
URL = f"amqp://guest:{PASSWORD}@localhost:{PORT}/%2F"


# --- options --------------------------------------------------------------------------------------


def test_create_with_defaults_and_several_urls() -> None:
    options = PublisherOptions.create(URL)
    assert options.urls == (URL,)
    assert (options.max_in_flight, options.delivery_timeout) == (10_000, 120.0)
    assert options.nack_policy == DEFAULT_NACK_POLICY
    two = PublisherOptions.create([URL, "amqps://h2:5671/vh"], max_in_flight=5)
    assert two.urls == (URL, "amqps://h2:5671/vh") and two.max_in_flight == 5


def test_create_rejects_unknown_options() -> None:
    with pytest.raises(ConfigurationError, match="'max_inflight'"):
        PublisherOptions.create(URL, max_inflight=10)


@pytest.mark.parametrize(
    "url",
    [
        f"http://guest:{PASSWORD}@localhost/",
        f"amqp://guest:{PASSWORD}@localhost:99999/",
        f"amqp://guest:{PASSWORD}@localhost:port/",
        f"amqp://guest:{PASSWORD}@/",
        f"//guest:{PASSWORD}@localhost/",
        "",
    ],
)
def test_malformed_urls_are_rejected_without_showing_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(url)
    assert PASSWORD not in str(info.value)
    assert "URL" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        f"guest:{PASSWORD}@localhost:{PORT}/%2F",
        f"amqp://guest:pass/word@localhost:{PORT}/",
        f"amqp://guest:pass#word@localhost:{PORT}/",
        f"amqp://guest:pass?word@localhost:{PORT}/",
    ],
)
def test_malformed_urls_never_show_the_password(url: str) -> None:
    password = url.split("@", maxsplit=1)[0].split(":", 2)[-1].removeprefix("//")
    with pytest.raises(ConfigurationError) as info:
        check_url(url)
    assert password not in str(info.value)


@pytest.mark.parametrize(
    "options",
    [
        {"max_in_flight": 0},
        {"max_in_flight": "10"},
        {"max_in_flight_bytes": -1},
        {"delivery_timeout": 0},
        {"publish_timeout": float("inf")},
        {"connect_timeout": float("nan")},
        {"close_timeout": True},
        {"blocked_timeout": 0},
        {"heartbeat": -1},
        {"heartbeat": 70_000},
        {"heartbeat": 1.5},
        {"nack_policy": {"max_attempts": 0}},
        {"connect_policy": "fast"},
    ],
)
def test_create_rejects_bad_values(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(URL, **options)
    assert PASSWORD not in str(info.value)


def test_policies_may_be_given_as_dicts_over_the_option_defaults() -> None:
    options = PublisherOptions.create(URL, nack_policy={"max_retries": 1}, connect_policy=None)
    assert options.nack_policy == dataclasses.replace(
        DEFAULT_NACK_POLICY, max_attempts=2, multiplier=1.0, jitter=0.0
    )
    assert options.connect_policy == DEFAULT_CONNECT_POLICY
    partial = PublisherOptions.create(URL, connect_policy={"deadline": "30"})
    assert partial.connect_policy == dataclasses.replace(DEFAULT_CONNECT_POLICY, deadline=30.0)


@pytest.mark.parametrize(
    "url, shown",
    [
        (URL, f"amqp://guest:***@localhost:{PORT}/%2F"),
        ("amqps://u:p%40ss@h/vh", "amqps://u:***@h/vh"),
        (f"amqp://u:p@ss@h:{PORT}", f"amqp://u:***@h:{PORT}"),
        ("amqp://u:@h/", "amqp://u:***@h/"),
        ("amqp://u@h/", "amqp://u@h/"),
        (f"amqp://h:{PORT}/", f"amqp://h:{PORT}/"),
    ],
)
def test_redact_url_hides_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_repr_of_options_hides_passwords() -> None:
    options = PublisherOptions.create([URL, f"amqp://u:{PASSWORD}x@h2/"])
    assert PASSWORD not in repr(options)
    assert "guest:***@localhost" in repr(options)


def test_from_strings_parses_strings_and_dotted_policy_keys() -> None:
    options = PublisherOptions.from_strings(
        URL,
        {
            "max_in_flight": " 1000 ",
            "max_in_flight_bytes": "2048",
            "heartbeat": "0",
            "delivery_timeout": "30.5",
            "publish_timeout": "5",
            "blocked_timeout": "none",
            "dedup_header": "x-dedup",
            "connection_name": "",
            "nack_policy.max_attempts": "3",
            "nack_policy.initial_delay": "0.5",
            "connect_policy.max_retries": "2",
            "connect_policy.interval_step": "1",
        },
    )
    assert (options.max_in_flight, options.max_in_flight_bytes, options.heartbeat) == (
        1000,
        2048,
        0,
    )
    assert (options.delivery_timeout, options.publish_timeout) == (30.5, 5.0)
    assert options.blocked_timeout is None
    assert (options.dedup_header, options.connection_name) == ("x-dedup", None)
    assert options.nack_policy == dataclasses.replace(
        DEFAULT_NACK_POLICY, max_attempts=3, initial_delay=0.5
    )
    assert options.connect_policy == dataclasses.replace(
        DEFAULT_CONNECT_POLICY, max_attempts=3, step=1.0, multiplier=1.0, jitter=0.0
    )
    assert PublisherOptions.from_strings(URL, {"blocked_timeout": "2.5"}).blocked_timeout == 2.5


@pytest.mark.parametrize(
    "options, named",
    [
        ({"max_in_flight": "many"}, "max_in_flight"),
        ({"heartbeat": "1.5"}, "heartbeat"),
        ({"delivery_timeout": "soon"}, "delivery_timeout"),
        ({"delivery_timeout": "inf"}, "delivery_timeout"),
        ({"nack_policy": "3"}, "nack_policy"),
        ({"nack_policy.bogus": "1"}, "bogus"),
        ({"connect_policy.max_attempts": "x"}, "max_attempts"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_from_strings_rejects_bad_strings(options: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        PublisherOptions.from_strings(URL, options)


# --- kwargs(): the options that rebuild these -----------------------------------------------------


def _hook(event: PublisherEvent) -> None:
    """An on_event hook for the options below."""


def test_kwargs_names_every_option_but_the_urls() -> None:
    options = PublisherOptions.create(URL)
    names = {f.name for f in dataclasses.fields(PublisherOptions)} - {"urls"}
    assert set(options.kwargs()) == names and len(names) >= 29
    assert options.kwargs() == {
        "max_in_flight": 10_000,
        "max_in_flight_bytes": 64 * 1024 * 1024,
        "publish_timeout": 60.0,
        "delivery_timeout": 120.0,
        "connect_timeout": 10.0,
        "heartbeat": 5,
        "close_timeout": 30.0,
        "exit_timeout": 10.0,
        "mandatory": True,
        "blocked_timeout": None,
        "connect_policy": DEFAULT_CONNECT_POLICY,
        "nack_policy": DEFAULT_NACK_POLICY,
        "dedup_header": None,
        "connection_name": None,
        "on_event": None,
        "username": None,
        "password": None,
        "ssl_context": None,
        "ca_file": None,
        "cert_file": None,
        "key_file": None,
        "key_password": None,
        "server_hostname": None,
        "tls_verify": True,
        "spool": None,
        "spool_max_bytes": 1024**3,
        "spool_fsync": "persist",
        "tracer_provider": None,
        "meter_provider": None,
    }


def test_kwargs_rebuild_equal_options() -> None:
    options = PublisherOptions.create(
        [URL, "amqps://u:p@h2:5671/vh"],
        max_in_flight=7,
        max_in_flight_bytes=1024,
        publish_timeout=1.5,
        delivery_timeout=9.0,
        connect_timeout=2.0,
        heartbeat=0,
        close_timeout=3.0,
        blocked_timeout=4.0,
        connect_policy={"max_attempts": 2},
        nack_policy=RetryPolicy(max_attempts=1, jitter=0.0),
        dedup_header="x-dedup",
        connection_name="etl",
        on_event=_hook,
    )
    kwargs = options.kwargs()
    assert kwargs["on_event"] is _hook and kwargs["nack_policy"] is options.nack_policy
    assert PublisherOptions.create(list(options.urls), **kwargs) == options
    assert PublisherOptions(urls=options.urls, **kwargs) == options


def test_kwargs_is_a_fresh_dict_each_time() -> None:
    options = PublisherOptions.create(URL)
    kwargs = options.kwargs()
    kwargs["max_in_flight"] = 1
    assert options.kwargs()["max_in_flight"] == 10_000 and options.max_in_flight == 10_000


# --- URLs: redaction edge cases, check_url, vhost_of, default_url ---------------------------------


@pytest.mark.parametrize(
    "url, shown",
    [
        (
            f"guest:pw@h:{PORT}/",
            f"guest:***@h:{PORT}/",
        ),  # no scheme: the fallback still hides it
        ("amqp://u:p:q@h/", "amqp://u:***@h/"),  # a colon inside the password
        ("amqps://:pw@h/", "amqps://:***@h/"),  # empty user name
        (f"amqp://u:p@[::1]:{PORT}/vh", f"amqp://u:***@[::1]:{PORT}/vh"),
        (f"amqp://[::1]:{PORT}/", f"amqp://[::1]:{PORT}/"),
        ("amqp://u:p@[h/", "amqp://u:***@[h/"),  # urlsplit raises ValueError: fallback
        ("amqp://u:p@h:port/", "amqp://u:***@h:port/"),  # a bad port is not redaction's job
        ("amqp://u:pa%2Fss@h", "amqp://u:***@h"),
        ("amqp://u:p/w@h/x?y#z", "amqp://u:***@h/x?y#z"),
        ("amqp://u:p?w@h/", "amqp://u:***@h/"),
        ("amqp://u:p@h/vh?heartbeat=5#frag", "amqp://u:***@h/vh?heartbeat=5#frag"),
        ("amqp://u:p@", "amqp://u:***@"),
        ("@", "@"),
        ("", ""),
        ("amqp://h/vh", "amqp://h/vh"),
    ],
)
def test_redact_url_edge_cases(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [None, b"amqp://u:secret@h/", 5, ["amqp://u:p@h/"]])
def test_redact_url_of_a_non_str_shows_nothing_of_it(url: object) -> None:
    assert redact_url(url) == "<not a url>"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url, shown",
    [
        ("amqp://u:p@x/y@h/", "amqp://u:***@h/"),
        ("amqp://u:p@x?y@h/", "amqp://u:***@h/"),
        ("amqp://u:p@x#y@h/", "amqp://u:***@h/"),
        (f"amqp://u:p@x/y@h:{PORT}/vh?heartbeat=5", f"amqp://u:***@h:{PORT}/vh?heartbeat=5"),
        ("amqp://u:a/b@c@h/", "amqp://u:***@h/"),  # '/' before the first '@'
        ("amqp://u:p@h/v@x", "amqp://u:***@x"),  # ambiguous: hide more
        ("amqp://u@h/v:w@x", "amqp://u@h/v:***@x"),  # 'w' may be a password: hide it
        ("amqp://u:1@2/3@h/", "amqp://u:***@h/"),
        ("amqp://h:/w@x/", "amqp://h:***@x/"),  # an empty port: a password '/w' perhaps
        ("amqp://h:99999/w@x/", "amqp://h:***@x/"),  # not a port
        ("amqp://h:\uff15/w@x/", "amqp://h:***@x/"),  # fullwidth digit: not a port
        ("u:p@x/y@h/", "u:***@h/"),  # no scheme
        ("amqp://a?:s@h/", "amqp://a?:***@h/"),  # a user name holding '?'
        ("amqp://h/v:w@x", "amqp://h/v:***@x"),  # user 'h/v', password 'w'; or a vhost
        ("amqp://[::1]/v:w@x", "amqp://[:***@x"),  # the same: hide from the first ':'
    ],
)
def test_redact_url_hides_a_password_with_at_and_slash(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    # whichever '@' ends the user info, its password lies between the first ':' and the last '@'
    rest = url.partition("://")[2] or url
    widest = rest[: rest.rfind("@")].partition(":")[2]
    assert widest and widest not in shown


@pytest.mark.parametrize(
    "url",
    [
        f"amqp://h:{PORT}/v@x",
        "amqp://h/v@x",
        "amqp://h/vh?heartbeat=5#a@b",
        f"amqp://h:{PORT}/vh#a:b@c",
        f"amqp://[::1]:{PORT}/v@x",
        "amqp://u@h/",
        "amqp://u@h/v@x",  # no ':' before the last '@': no password in any reading
    ],
)
def test_redact_url_keeps_a_url_without_password_with_at_in_the_vhost(url: str) -> None:
    # the text before the first '/', '?' or '#' is a valid host[:port], as the connection
    # reads it, and no ':' after the host could start a password: the '@' is in the path,
    # query or fragment
    assert redact_url(url) == url


@pytest.mark.parametrize(
    "url", ["amqp://h", "amqps://u:p@h:5671/vh", "amqp://h:65535/", "AMQP://h/", "amqp://[::1]/"]
)
def test_check_url_returns_good_urls_unchanged(url: str) -> None:
    assert check_url(url) is url


@pytest.mark.parametrize(
    "url, problem",
    [
        (None, "a broker URL must be a non-empty str, got None"),
        (b"amqp://h/", "a broker URL must be a non-empty str, got b'amqp://h/'"),
        ("amqp://u:secret@h:0/", "broker URL amqp://u:***@h:0/ has an invalid port"),
        (f"amqp://u:secret@:{PORT}/", f"broker URL amqp://u:***@:{PORT}/ has no host"),
        (
            "http://u:secret@h/",
            "broker URL http://u:***@h/ must start with amqp:// or amqps://, not http://",
        ),
        (f"h:{PORT}", f"broker URL h:{PORT} must start with amqp:// or amqps://, not h://"),
    ],
)
def test_check_url_errors_are_exact(url: object, problem: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        check_url(url)
    assert str(info.value) == problem


@pytest.mark.parametrize(
    "url, vhost",
    [
        ("amqp://h", "/"),
        ("amqp://h/", "/"),
        (f"amqp://h:{PORT}/%2F", "/"),
        ("amqp://u:p@h/prod", "prod"),
        ("amqp://h/a%20b", "a b"),
        ("amqp://h//x", "/x"),
        ("amqp://h/vh?heartbeat=5", "vh"),
    ],
)
def test_vhost_of(url: str, vhost: str) -> None:
    assert vhost_of(url) == vhost


def test_default_url_escapes_the_vhost_and_round_trips() -> None:
    assert default_url() == f"amqp://guest:guest@127.0.0.1:{PORT}/%2F"
    url = default_url("broker", 5673, "team/a b")
    assert url == "amqp://guest:guest@broker:5673/team%2Fa%20b"
    assert vhost_of(url) == "team/a b" and check_url(url) == url


# --- direct construction --------------------------------------------------------------------------


def test_options_need_a_url_and_a_callable_hook() -> None:
    with pytest.raises(ConfigurationError, match="at least one broker URL is needed"):
        PublisherOptions(urls=())
    with pytest.raises(ConfigurationError, match="at least one broker URL is needed"):
        PublisherOptions.create([])
    with pytest.raises(ConfigurationError, match="on_event must be callable"):
        PublisherOptions.create(URL, on_event="print")
    with pytest.raises(ConfigurationError, match="nack_policy must be a RetryPolicy"):
        PublisherOptions(urls=(URL,), nack_policy={"max_attempts": 1})  # type: ignore[arg-type]


def test_from_strings_blank_values_mean_unset() -> None:
    options = PublisherOptions.from_strings(
        URL, {"blocked_timeout": " None ", "dedup_header": "", "connect_policy.deadline": "none"}
    )
    assert options.blocked_timeout is None and options.dedup_header is None
    assert options.connect_policy == dataclasses.replace(DEFAULT_CONNECT_POLICY, deadline=None)
    with pytest.raises(ConfigurationError, match=r"set nack_policy as nack_policy\.<field>"):
        PublisherOptions.from_strings(URL, {"nack_policy": "3"})


# --- URL query, heartbeat, credentials and TLS options (issue 11) --------------------------------


@pytest.mark.parametrize(
    "url, heartbeat",
    [
        ("amqp://h/", None),
        ("amqp://h/?heartbeat=0", 0),
        ("amqp://h/vh?heartbeat=15", 15),
        ("amqp://u:heartbeat@h/", None),  # the word in a password is no setting
        ("amqp://u:p@h/heartbeat", None),
    ],
)
def test_url_heartbeat_reads_the_query_only(url: str, heartbeat: int | None) -> None:
    assert url_heartbeat(url) == heartbeat


def test_the_url_heartbeat_is_the_heartbeat_option() -> None:
    assert PublisherOptions.create("amqp://h/?heartbeat=0").heartbeat == 0
    assert PublisherOptions.create("amqp://u:heartbeat@h/").heartbeat == 5
    assert PublisherOptions.create("amqp://h/?heartbeat=5", heartbeat=5).heartbeat == 5
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create("amqp://h/?heartbeat=5", heartbeat=10)
    assert str(info.value) == (
        "broker URL amqp://h/?heartbeat=5 says heartbeat=5 but the heartbeat option is 10: "
        "give it once"
    )
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(["amqp://a/?heartbeat=5", "amqp://b/?heartbeat=6"])
    assert str(info.value) == (
        "the broker URLs give different heartbeats: set the heartbeat option instead"
    )
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create("amqp://u:s3cret@h/?heartbeat=x")
    assert str(info.value) == (
        "broker URL amqp://u:***@h/?heartbeat=x: heartbeat must be a whole number of seconds "
        "from 0 to 65535"
    )


@pytest.mark.parametrize(
    "query, problem",
    [
        ("no_verify_ssl=1", "the URL parameter 'no_verify_ssl' configures TLS"),
        ("cafile=/tmp/ca.pem", "the URL parameter 'cafile' configures TLS"),
        ("ssl_options=%7B%7D", "the URL parameter 'ssl_options' configures TLS"),
        ("name=x", "the URL parameter 'name' is not accepted; use the publisher option "),
        ("locale=en", "unknown URL parameter 'locale'"),
        ("heartbeat=5&heartbeat=6", "the URL parameter 'heartbeat' is given twice"),
    ],
)
def test_url_parameters_accept_heartbeat_only(query: str, problem: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(f"amqps://u:{PASSWORD}@h/?{query}")
    assert problem in str(info.value) and PASSWORD not in str(info.value)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("amqps://h/?ssl_options={'password':'pw'}", "amqps://h/?ssl_options=***"),
        ("amqp://u:p@h/?heartbeat=5&cafile=x", "amqp://u:***@h/?heartbeat=5&cafile=***"),
        ("amqp://h/#?x=1", "amqp://h/#?x=1"),
    ],
)
def test_redact_url_hides_query_values_but_heartbeat(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:Zq7/Xw9@host",
        "amqp://guest:Zq7?Xw9@host",
        "amqp://guest:Zq7#Xw9@host",
        "amqp://guest:12/34@host/",  # parses as host 'guest', port 12: refused, raw '@'
    ],
)
def test_urls_that_do_not_parse_never_quote_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        PublisherOptions.create(url)
    password = url.split(":")[2].rsplit("@", 1)[0]
    for fragment in (password, *password.replace("?", "/").replace("#", "/").split("/")):
        assert fragment not in str(info.value)
    assert "percent-encoded" in str(info.value)


def test_credentials_and_tls_options_from_strings_and_checks() -> None:
    options = PublisherOptions.from_strings(
        "amqps://h/",
        {
            "username": "app",
            "password": "pw",
            "ca_file": "/ca.pem",
            "cert_file": "/c.pem",
            "key_file": "",
            "server_hostname": "broker",
            "tls_verify": "false",
        },
    )
    assert (options.username, options.password, options.ca_file) == ("app", "pw", "/ca.pem")
    assert (options.key_file, options.server_hostname, options.tls_verify) == (
        None,
        "broker",
        False,
    )
    assert "pw" not in repr(options)
    problems: list[tuple[dict[str, Any], str, str]] = [
        ({"ca_file": "/ca.pem"}, "amqp://h/", "ca_file set but no broker URL uses TLS"),
        ({"key_file": "/k.pem"}, "amqps://h/", "key_file and key_password need cert_file"),
        ({"password": 5}, "amqp://h/", "password must be a str or None, got int"),
        ({"tls_verify": "no"}, "amqps://h/", "tls_verify must be True or False, got 'no'"),
        ({"ssl_context": object()}, "amqps://h/", "ssl_context must be an ssl.SSLContext"),
    ]
    for kwargs, url, problem in problems:
        with pytest.raises(ConfigurationError) as info:
            PublisherOptions.create(url, **kwargs)
        assert problem in str(info.value)
    with pytest.raises(ConfigurationError, match="tls_verify must be true or false, got 'maybe'"):
        PublisherOptions.from_strings("amqps://h/", {"tls_verify": "maybe"})


def test_an_ssl_context_must_verify_unless_told() -> None:
    import ssl

    context = ssl.create_default_context()
    assert PublisherOptions.create("amqps://h/", ssl_context=context).ssl_context is context
    lax = ssl.create_default_context()
    lax.check_hostname = False
    with pytest.raises(ConfigurationError, match="does not verify the broker's certificate"):
        PublisherOptions.create("amqps://h/", ssl_context=lax)
    with pytest.raises(ConfigurationError, match="give either ssl_context or ca_file"):
        PublisherOptions.create("amqps://h/", ssl_context=context, ca_file="/ca.pem")


@pytest.mark.parametrize(
    "url, options, expected",
    [
        ("amqp://h/", {}, ("guest", "guest")),
        ("amqp://bob:pw@h/", {}, ("bob", "pw")),
        ("amqp://b%40b:p%2Fw@h/", {}, ("b@b", "p/w")),
        ("amqp://bob:pw@h/", {"username": "ann"}, ("ann", "pw")),
        ("amqp://bob:pw@h/", {"password": "new"}, ("bob", "new")),
        ("amqp://h/", {"username": "ann"}, ("ann", "guest")),
        ("amqp://h/", {"username": "ann", "password": ""}, ("ann", "")),
    ],
)
def test_login_is_the_options_then_the_url_then_guest(
    url: str, options: dict[str, str], expected: tuple[str, str]
) -> None:
    assert PublisherOptions.create(url, **options).login(url) == expected
