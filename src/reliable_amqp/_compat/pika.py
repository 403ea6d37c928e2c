"""Every hook of the sync publisher and the consumers into pika internals, probed at import.

- ``BaseConnection._adapter_emit_data``: where a connection hands its frames to the socket;
  :class:`CoalescingConnection` overrides it to gather many publishes into one write. pika
  documents it as the adapter's override point, but it is still underscore-private.
- ``Connection._terminate_stream``: pika's own path for a dead stream (closes the socket and
  reports the loss through the usual callbacks); :func:`terminate_stream` calls it when the
  publisher's liveness check finds a silent link sooner than pika's heartbeat would.
- ``Connection._on_data_available`` (every read from the socket), with ``_frame_buffer``,
  ``_process_frame`` and ``bytes_received``, and ``pika.frame.decode_frame``: the consumer's
  :class:`ScanningConnection` takes its deliveries' frames out of each read before pika decodes
  the rest (pika 1.3 to 1.4 alike).
- ``BlockingConnection(parameters, _impl_class=...)``: the class a blocking connection drives
  (pika calls the argument "for tests/debugging"); :func:`scanning_blocking_connection` passes
  :class:`ScanningConnection`, so a blocking reader (the Spark stream reader) decodes its
  deliveries the consumer's way.
- ``AsyncioConnection`` with the same ``_on_data_available`` override
  (:class:`LoopScanningConnection`, the async consumer's, on the event loop), whose
  ``_adapter_emit_data`` takes a lock, and its transport's ``_sock`` and
  ``get_write_buffer_size()`` (``pika.adapters.utils.io_services_utils``): a watchdog thread
  writes heartbeats there while a handler blocks the loop.
"""

from __future__ import annotations

import inspect
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pika
from pika import frame as pika_frame
from pika.adapters.asyncio_connection import AsyncioConnection
from pika.adapters.select_connection import SelectConnection
from pika.adapters.utils import io_services_utils

from reliable_amqp._compat import IncompatibleDependency, require_attributes
from reliable_amqp._core.delivery import Delivery, DeliveryScanner, HeaderDecodeError

__all__ = [
    "HEARTBEAT_FRAME",
    "CoalescingConnection",
    "LoopScanningConnection",
    "ScanningConnection",
    "probe",
    "scanner_takes_deliveries",
    "scanning_blocking_connection",
    "terminate_stream",
]


def probe(connection_class: Any = SelectConnection) -> None:
    """Check that pika's connection class has the hooks this module uses.

    Raises :class:`~reliable_amqp._compat.IncompatibleDependency` naming pika, its installed
    version and the supported range. Run at import; the argument lets tests probe a stand-in.
    """
    require_attributes(
        "pika",
        connection_class,
        ["_adapter_emit_data", "_terminate_stream", "_on_data_available", "_process_frame"],
        f"its {getattr(connection_class, '__name__', 'connection class')}",
    )


probe()
probe(AsyncioConnection)
require_attributes(
    "pika",
    io_services_utils._AsyncTransportBase,
    ["get_write_buffer_size", "write"],
    "its asyncio transport (pika.adapters.utils.io_services_utils)",
)
require_attributes("pika", pika_frame, ["decode_frame"], "its pika.frame module")
if "_impl_class" not in inspect.signature(pika.BlockingConnection.__init__).parameters:
    raise IncompatibleDependency("pika", "its BlockingConnection takes no _impl_class")


class CoalescingConnection(SelectConnection):  # type: ignore[misc]
    """A SelectConnection that can gather the frames of many publishes into one write.

    pika hands every frame to the socket separately (three ``send()`` calls per message); between
    :meth:`begin_gather` and :meth:`emit_gathered`, frames collect here and go out as one buffer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._gather = False
        self._gathered: list[bytes | memoryview] = []
        super().__init__(*args, **kwargs)

    def _adapter_emit_data(self, data: bytes) -> None:
        if self._gather:
            self._gathered.append(data)
        else:
            super()._adapter_emit_data(data)

    def begin_gather(self) -> list[bytes | memoryview]:
        """Start gathering; frames appended to the returned list go out on emit_gathered()."""
        self._gather = True
        return self._gathered

    def emit_gathered(self) -> None:
        """Write what was gathered as one buffer and stop gathering."""
        self._gather = False
        if self._gathered:
            data = b"".join(self._gathered)
            self._gathered.clear()
            # As a memoryview: when the socket takes part of a buffer, pika requeues the rest as
            # ``chunk[sent:]``, which copies a bytes object (a batch of 1 KiB messages is ~2 MiB,
            # sent in several parts: quadratic copying) but only slices a view.
            super()._adapter_emit_data(memoryview(data))


def terminate_stream(connection: pika.connection.Connection, error: Exception) -> bool:
    """End ``connection``'s stream as pika does for a dead one; False if pika cannot.

    The socket is closed and the loss reported through the connection's close callbacks with
    ``error``. Only from the connection's I/O thread. On False (a connection object without the
    hook, such as a test double) the caller must end the link another way (stop the I/O loop).
    """
    terminate = getattr(connection, "_terminate_stream", None)
    if terminate is None:
        return False
    terminate(error)
    return True


class _FrameScanning:
    """What both scanning connections add to pika's: ``Connection._on_data_available`` (pika
    hands it every read from the socket) lets a scanner take the delivery frames of its channel;
    every other frame goes through pika's own ``decode_frame``/``_process_frame``, in order.
    ``bytes_received`` moves as pika's does, so its heartbeat checker sees the traffic."""

    scanner: DeliveryScanner | None
    on_deliveries: Callable[[list[Delivery]], None]

    def _on_data_available(self, data_in: bytes) -> None:
        # self is a pika Connection: its private parts are read through Any
        conn: Any = self
        buffer: bytes = cast(bytes, conn.__dict__["_frame_buffer"])
        data = buffer + data_in if buffer else data_in
        pos = 0
        size = len(data)
        try:
            while pos < size:
                scanner = self.scanner
                if scanner is None:
                    consumed, value = pika_frame.decode_frame(data[pos:])
                    if not value:
                        break
                    pos += consumed
                    conn.bytes_received += consumed
                    conn._process_frame(value)
                    continue
                start = pos
                pos, end = scanner.scan(data, pos)
                conn.bytes_received += pos - start
                if scanner.ready:
                    batch = scanner.ready
                    scanner.ready = []
                    self.on_deliveries(batch)
                if end == pos:
                    break
                consumed, value = pika_frame.decode_frame(data[pos:end])
                pos = end
                conn.bytes_received += consumed
                if value:
                    conn._process_frame(value)
        except HeaderDecodeError as exc:
            conn._frame_buffer = b""
            conn._terminate_stream(exc)
            return
        conn._frame_buffer = data[pos:] if pos < size else b""


#: what one read of the sync consumer's socket asks for. pika's transports ask 4 KiB: about 25
#: small deliveries, each read's batch a hand-off to the handler thread (asyncio's transports,
#: the async consumer's, ask 256 KiB). A prefetch of 200 small messages is about 30 KiB.
RECV_BYTES = 64 * 1024


class ScanningConnection(_FrameScanning, SelectConnection):  # type: ignore[misc]
    """A SelectConnection whose consuming channel's deliveries bypass pika's frame decoding
    (:class:`_FrameScanning`): the sync consumer's, on its I/O thread. Its socket is read
    :data:`RECV_BYTES` at a time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.scanner = None
        self.on_deliveries = _no_deliveries
        super().__init__(*args, **kwargs)

    def _proto_connection_made(self, transport: Any) -> None:
        # pika's stream transports (plain and TLS, pika 1.3 to 1.4) read _MAX_RECV_BYTES at a
        # time, up to _MAX_CONSUME_BYTES (100 KiB) an event
        if isinstance(getattr(transport, "_MAX_RECV_BYTES", None), int):
            transport._MAX_RECV_BYTES = RECV_BYTES
        super()._proto_connection_made(transport)


def _no_deliveries(batch: list[Delivery]) -> None:
    """Where a scanning connection's deliveries go until its owner says."""


#: a heartbeat frame (type 8, channel 0, no payload, frame-end)
HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"


class LoopScanningConnection(_FrameScanning, AsyncioConnection):  # type: ignore[misc]
    """An AsyncioConnection (pika on the running event loop: set-up, TLS, authentication,
    channels) whose deliveries are scanned as :class:`ScanningConnection`'s are: the async
    consumer's, with no thread of its own.

    ``_adapter_emit_data`` (every write pika makes) runs under ``write_lock``, so that
    :meth:`heartbeat_from_thread` can put a heartbeat on the wire from another thread while the
    event loop is blocked (a handler's blocking call), without cutting into a frame.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.scanner = None
        self.on_deliveries = _no_deliveries
        self.write_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _adapter_emit_data(self, data: bytes) -> None:
        # pika's transport never writes at once: it buffers, asks the loop to watch for
        # writability and sends on the next pass. On a plain socket with nothing waiting, send
        # now (asyncio's own transports do the same): one pass and two epoll_ctl calls fewer a
        # write, and nothing of pika's is left pending while a handler blocks the loop (the
        # watchdog writes heartbeats only between frames). The rest, if any, goes pika's way.
        with self.write_lock:
            transport = self.__dict__.get("_transport")
            sock = getattr(transport, "_sock", None)
            if (
                transport is not None
                and type(sock) is socket.socket
                and not transport.get_write_buffer_size()
            ):
                try:
                    sent = sock.send(data)
                except OSError:  # would block, or a broken socket: pika's path finds out
                    sent = 0
                if sent == len(data):
                    return
                data = data[sent:]
            super()._adapter_emit_data(data)

    def emit_frames(self, data: bytes) -> None:
        """Write whole frames encoded elsewhere (the consumer's acks), counted as pika counts
        its own (``bytes_sent``, for its heartbeat checker)."""
        self.bytes_sent += len(data)
        self.frames_sent += 1
        self._adapter_emit_data(data)

    def heartbeat_from_thread(self) -> bool:
        """Write a heartbeat frame from a thread that is not the event loop's; True if written.

        Only on a plain TCP socket (an SSL socket's state is the loop thread's alone), and only
        when pika has no bytes waiting to go out: under ``write_lock`` no write of pika's starts,
        and with its buffer empty none is under way, so the 8 bytes go between two frames.
        """
        with self.write_lock:
            transport = getattr(self, "_transport", None)
            sock = getattr(transport, "_sock", None)
            if transport is None or type(sock) is not socket.socket:
                return False
            if transport.get_write_buffer_size():
                return False
            data = HEARTBEAT_FRAME
            deadline = time.monotonic() + 5.0
            while data:
                try:
                    sent = sock.send(data)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    return False
                data = data[sent:]
                if data:  # the socket's buffer is full: wait (pika cannot write meanwhile)
                    if time.monotonic() > deadline:
                        return False
                    select.select([], [sock], [], 0.1)
            return True


def scanning_blocking_connection(parameters: pika.ConnectionParameters) -> pika.BlockingConnection:
    """A ``BlockingConnection`` over a :class:`ScanningConnection` (reach it as ``._impl``)."""
    return pika.BlockingConnection(parameters, _impl_class=ScanningConnection)


def scanner_takes_deliveries(*_args: Any) -> None:  # pragma: no cover - never called
    """The ``on_message_callback`` pika's ``basic_consume`` requires, for a consumer whose
    deliveries a :class:`ScanningConnection`'s scanner takes before pika sees them."""
    raise AssertionError("a delivery reached pika's consumer callback")
