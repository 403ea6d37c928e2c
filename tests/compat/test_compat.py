"""The compat probes: they pass on what is installed, and a missing hook fails loudly.

Each probe is tested against stand-ins missing one hook, never by breaking the real package:
the error must name the package, its installed version and the supported range.
"""

from __future__ import annotations

import asyncio
import types
from concurrent.futures import Future
from typing import Any

import aio_pika
import aiormq
import aiormq.exceptions
import pika.exceptions
import pytest
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.exceptions import AMQPInternalError
from pamqp.header import ContentHeader

from reliable_amqp import _compat
from reliable_amqp._compat import (
    AIORMQ_RANGE,
    PIKA_RANGE,
    SUPPORTED,
    IncompatibleDependency,
    installed_version,
    require_attributes,
    scrub_credentials,
)
from reliable_amqp._compat import aiormq as compat_aiormq
from reliable_amqp._compat import futures as compat_futures
from reliable_amqp._compat import pika as compat_pika
from reliable_amqp._core.errors import AmqpConnectionError, AuthenticationFailed
from reliable_amqp._sync._pika import translate_connection_error as translate_pika
from support.broker import AMQP_DEFAULT_PORT

# --- the probes on the installed versions -----------------------------------------------------


def test_every_probe_passes_on_the_installed_versions() -> None:
    compat_pika.probe()
    compat_aiormq.probe()
    assert compat_futures.probe()
    assert compat_futures.LIGHT_FUTURES


def test_the_ranges_cover_the_installed_versions() -> None:
    # Only the major.minor bounds matter here; pip enforces the ranges themselves.
    for package, supported in SUPPORTED.items():
        low, high = supported.split(",")
        assert low.startswith(">=") and high.startswith("<"), supported
        installed = tuple(int(p) for p in installed_version(package).split(".")[:2])
        lowest = tuple(int(p) for p in low[2:].split("."))
        assert lowest <= installed < (int(high[1:]),), (package, installed, supported)


# --- a missing hook -----------------------------------------------------------------------------


def _assert_names_package(error: IncompatibleDependency, package: str, hook: str) -> None:
    message = str(error)
    assert package in message
    assert installed_version(package) in message
    assert SUPPORTED[package] in message
    assert hook in message
    assert isinstance(error, ImportError)
    assert (error.package, error.installed, error.supported) == (
        package,
        installed_version(package),
        SUPPORTED[package],
    )


def test_pika_without_terminate_stream_is_refused() -> None:
    class OldConnection:
        def _adapter_emit_data(self, data: bytes) -> None: ...

    with pytest.raises(IncompatibleDependency) as info:
        compat_pika.probe(OldConnection)
    _assert_names_package(info.value, "pika", "_terminate_stream")
    assert PIKA_RANGE in str(info.value)


def _fake_aiormq(**overrides: Any) -> types.SimpleNamespace:
    """aiormq as the probe sees it, with some parts replaced."""
    parts: dict[str, Any] = {"abc": aiormq.abc, "Connection": aiormq.Connection, **overrides}
    return types.SimpleNamespace(**parts)


def test_aiormq_channel_without_a_frame_queue_is_refused() -> None:
    class AbstractChannel:  # no ``frames``
        number: int

    fake = _fake_aiormq(abc=types.SimpleNamespace(AbstractChannel=AbstractChannel))
    with pytest.raises(IncompatibleDependency) as info:
        compat_aiormq.probe(fake)
    _assert_names_package(info.value, "aiormq", "frames")
    assert f"reliable-amqp needs aiormq {AIORMQ_RANGE}" in str(info.value)


def test_aiormq_connection_without_a_write_queue_is_refused() -> None:
    class Connection:
        connection_tune: object

        async def channel(self) -> None: ...

    with pytest.raises(IncompatibleDependency) as info:
        compat_aiormq.probe(_fake_aiormq(Connection=Connection))
    _assert_names_package(info.value, "aiormq", "write_queue")


def test_aiormq_channel_frame_without_a_drain_future_is_refused() -> None:
    from dataclasses import dataclass

    @dataclass
    class ChannelFrame:
        payload: bytes
        should_close: bool

    abc = types.SimpleNamespace(
        AbstractChannel=aiormq.abc.AbstractChannel, ChannelFrame=ChannelFrame
    )
    with pytest.raises(IncompatibleDependency) as info:
        compat_aiormq.probe(_fake_aiormq(abc=abc))
    _assert_names_package(info.value, "aiormq", "drain_future")


def test_aiormq_connection_that_keeps_no_last_frame_time_is_refused() -> None:
    # The async liveness check reads when aiormq last read a frame, and drops a silent link by
    # cancelling the reader task, as aiormq's own heartbeat watchdog does.
    class Connection(aiormq.Connection):
        def __init__(self) -> None:  # stamps no frame time
            pass

    with pytest.raises(IncompatibleDependency) as info:
        compat_aiormq.probe(_fake_aiormq(Connection=Connection))
    _assert_names_package(info.value, "aiormq", "_Connection__last_frame_time")

    class Watchdogless(aiormq.Connection):
        async def _Connection__heartbeat(self) -> None:  # never touches the reader task
            return None

    with pytest.raises(IncompatibleDependency) as info:
        compat_aiormq.probe(_fake_aiormq(Connection=Watchdogless))
    _assert_names_package(info.value, "aiormq", "_reader_task")


def test_aio_pika_without_a_transport_is_refused() -> None:
    class Connection:
        pass

    fake = types.SimpleNamespace(Connection=Connection, abc=aio_pika.abc)
    with pytest.raises(IncompatibleDependency) as info:
        compat_aiormq.probe(aiormq, fake)
    _assert_names_package(info.value, "aio-pika", "transport")


def test_an_unknown_package_still_gives_a_message() -> None:
    with pytest.raises(IncompatibleDependency) as info:
        require_attributes("no-such-dist", object(), ["hook"], "it")
    assert "no-such-dist (unknown version) is installed and it has no hook" in str(info.value)


def test_a_future_with_other_fields_falls_back_to_a_plain_future() -> None:
    class NewFuture(Future[Any]):
        def __init__(self) -> None:
            super().__init__()
            self._new_field = None

    assert not compat_futures.probe(NewFuture)
    assert compat_futures.probe(Future)


# --- error translation: each library's exceptions sorted into one classifier's kinds ----------


@pytest.mark.parametrize(
    ("error", "expected", "retriable"),
    [
        (aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED"), AuthenticationFailed, 0),
        (aiormq.exceptions.ConnectionNotAllowed("no vhost"), AuthenticationFailed, 0),
        (aiormq.exceptions.ConnectionClosed(530, "NOT_ALLOWED"), AuthenticationFailed, 0),
        (aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"), AmqpConnectionError, 1),
        # a missing vhost: connection.close (530) in answer to connection.open, as aiormq 6
        # (pamqp's AMQPInternalError) and aiormq 7 (InvalidFrameError) raise it
        (
            AMQPInternalError("one of ['Connection.OpenOk']", spec.Connection.Close(530, "NO")),
            AuthenticationFailed,
            0,
        ),
        (
            aiormq.exceptions.InvalidFrameError(spec.Connection.Close(530, "NOT_ALLOWED")),
            AuthenticationFailed,
            0,
        ),
        (asyncio.TimeoutError(), AmqpConnectionError, 1),
        (ConnectionResetError(104, "reset"), AmqpConnectionError, 1),
    ],
)
def test_aiormq_errors_are_classified(error: BaseException, expected: type, retriable: int) -> None:
    result = compat_aiormq.translate_connection_error(error)
    assert type(result) is expected
    assert result.retriable is bool(retriable)
    assert result.__cause__ is error


@pytest.mark.parametrize(
    ("error", "expected", "retriable"),
    [
        (pika.exceptions.ProbableAuthenticationError("ACCESS_REFUSED"), AuthenticationFailed, 0),
        (pika.exceptions.ProbableAccessDeniedError("no vhost"), AuthenticationFailed, 0),
        # pika's "probable" errors carry the repr of what ended the connection: the broker's
        # close is final, a lost stream (a reset mid-login) is retried
        (
            pika.exceptions.ProbableAuthenticationError(
                repr(pika.exceptions.ConnectionClosedByBroker(403, "ACCESS_REFUSED - Login"))
            ),
            AuthenticationFailed,
            0,
        ),
        (
            pika.exceptions.ProbableAuthenticationError(
                repr(pika.exceptions.StreamLostError("Stream connection lost: ConnectionReset"))
            ),
            AmqpConnectionError,
            1,
        ),
        (
            pika.exceptions.ProbableAccessDeniedError(
                repr(pika.exceptions.ConnectionClosedByBroker(530, "NOT_ALLOWED - vhost"))
            ),
            AuthenticationFailed,
            0,
        ),
        (
            pika.exceptions.ProbableAccessDeniedError(
                repr(pika.exceptions.StreamLostError("Transport indicated EOF"))
            ),
            AmqpConnectionError,
            1,
        ),
        (pika.exceptions.ConnectionClosedByBroker(403, "ACCESS_REFUSED"), AuthenticationFailed, 0),
        (pika.exceptions.ConnectionClosedByBroker(320, "FORCED"), AmqpConnectionError, 1),
        (pika.exceptions.StreamLostError("lost"), AmqpConnectionError, 1),
        (TimeoutError(), AmqpConnectionError, 1),
    ],
)
def test_pika_errors_are_classified(error: BaseException, expected: type, retriable: int) -> None:
    result = translate_pika(error)
    assert type(result) is expected
    assert result.retriable is bool(retriable)
    assert result.__cause__ is error


def test_no_translated_message_holds_a_password() -> None:
    text = f"cannot reach <Connection: amqp://guest:s3cret@host:{AMQP_DEFAULT_PORT}/>"
    assert "s3cret" not in scrub_credentials(text)
    assert "amqp://***@host" in scrub_credentials(text)
    assert "s3cret" not in str(compat_aiormq.translate_connection_error(ConnectionError(text)))
    assert "s3cret" not in str(translate_pika(pika.exceptions.AMQPConnectionError(text)))


# --- the frame tap and the write queue, without a broker ------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.confirms: list[tuple[int, bool, int, bool]] = []
        self.returns: list[tuple[Any, int, str]] = []

    def on_confirm(self, generation: int, ack: bool, tag: int, multiple: bool) -> None:
        self.confirms.append((generation, ack, tag, multiple))

    def on_return(
        self,
        headers: Any,
        reply_code: int,
        text: str,
        returned: tuple[str | None, str, str, bytes],
        generation: int,
    ) -> None:
        assert generation == 7
        self.returns.append((headers, reply_code, text))


def _tapped() -> tuple[compat_aiormq.ConfirmChannel, asyncio.Queue[Any], _Sink]:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    fake = types.SimpleNamespace(frames=queue, is_closed=False)
    sink = _Sink()
    channel = compat_aiormq.ConfirmChannel(fake, sink, 7)  # type: ignore[arg-type]
    channel._install_tap()
    return channel, queue, sink


def test_the_tap_takes_confirms_and_returns_and_passes_the_rest() -> None:
    async def run() -> None:
        channel, queue, sink = _tapped()
        await queue.put((0, spec.Basic.Ack(delivery_tag=1)))
        queue.put_nowait((0, spec.Basic.Nack(delivery_tag=3, multiple=True)))
        properties = spec.Basic.Properties(headers={"x-attempt": "a1"})
        await queue.put((0, spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE")))
        await queue.put((0, ContentHeader(0, 5, properties)))
        await queue.put((0, ContentBody(b"ab")))
        await queue.put((0, ContentBody(b"cde")))
        await queue.put((0, spec.Basic.Ack(delivery_tag=4)))
        await queue.put((0, spec.Channel.Close(reply_code=404, reply_text="NOT_FOUND")))
        assert sink.confirms == [(7, True, 1, False), (7, False, 3, True), (7, True, 4, False)]
        assert sink.returns == [({"x-attempt": "a1"}, 312, "NO_ROUTE")]
        assert channel.close_reply == (404, "NOT_FOUND")
        assert not channel.writable
        # Only channel.close reached aiormq's channel reader, once.
        assert queue.qsize() == 1
        assert isinstance((await queue.get())[1], spec.Channel.Close)

    asyncio.run(run())


def test_a_returned_message_without_a_body_is_reported() -> None:
    async def run() -> None:
        _, queue, sink = _tapped()
        await queue.put((0, spec.Basic.Return(reply_code=312, reply_text="NO_ROUTE")))
        await queue.put((0, ContentHeader(0, 0, spec.Basic.Properties())))
        assert sink.returns == [(None, 312, "NO_ROUTE")]
        assert queue.empty()

    asyncio.run(run())


def test_wait_writable_waits_for_room_without_polling() -> None:
    async def run() -> None:
        write_queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
        connection: Any = types.SimpleNamespace(write_queue=write_queue)
        first = compat_aiormq.write_payload(connection, b"first")
        assert write_queue.full()
        waiter = asyncio.ensure_future(compat_aiormq.wait_writable(connection))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        written: list[bytes] = []
        while not waiter.done():  # the connection's writer, as aiormq's drains its queue
            frame = await write_queue.get()
            written.append(frame.payload)
            frame.drain()
            await asyncio.sleep(0)
        await waiter
        assert first.done() and written[0] == b"first"
        assert not write_queue.full()
        drained = compat_aiormq.write_payload(connection, b"second")
        assert not drained.done()

    asyncio.run(run())


def test_compat_package_names_its_modules() -> None:
    assert _compat.__doc__ is not None
    for module in (compat_pika, compat_aiormq, compat_futures):
        assert module.__name__ in _compat.__doc__ or module.__name__.rsplit(".", 1)[1] in (
            _compat.__doc__
        )


def test_a_pika_getpeername_failure_reads_as_the_reset_it_was() -> None:
    # pika raises a ValueError with the socket error only as text when the peer resets the
    # connection as it opens (seen through benchmarks/spool_outage.py's refusing proxy): the
    # retry's warning said "ValueError: Expected connected socket, ..., <socket.socket fd=14 ...>"
    error = ValueError(
        "Expected connected socket, but getpeername() failed: error=OSError(107, 'Transport "
        "endpoint is not connected'); <socket.socket fd=14, family=2, type=1, proto=6, "
        "laddr=('127.0.0.1', 59252)>; "
    )
    params = pika.ConnectionParameters(host="127.0.0.1", port=5699)
    result = translate_pika(error, params)
    assert type(result) is AmqpConnectionError and result.retriable
    assert str(result) == "connection reset by 127.0.0.1:5699"
    assert result.__cause__ is error
    other = translate_pika(ValueError("something else"), params)  # not taken for a reset
    assert "reset" not in str(other)
