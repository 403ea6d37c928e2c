"""The broker's own ceiling: confirmed publishing with (almost) no client work.

All frames are encoded before the clock starts, then written as fast as the socket takes them
while basic.ack frames are read; the clock stops at the ack for the last delivery tag. What this
row reaches is what the broker (one durable queue, persistent messages, this machine) can confirm;
no client can do better, so it bounds every other row.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections.abc import Iterator
from urllib.parse import unquote, urlparse

import pika.frame
import pika.spec

from reliable_amqp._core.builder import build_message
from reliable_amqp._core.frames import publish_frames


class _Conn:
    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 5672))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.user = unquote(parsed.username or "guest")
        self.password = unquote(parsed.password or "guest")
        self.vhost = unquote(parsed.path[1:]) if len(parsed.path) > 1 else "/"
        self.buffer = b""

    def send(self, channel: int, method: object) -> None:
        self.sock.sendall(pika.frame.Method(channel, method).marshal())

    def frames(self) -> Iterator[object]:
        """Every whole frame in the buffer, taken out of it in order."""
        while self.buffer:
            consumed, frame = pika.frame.decode_frame(self.buffer)
            if frame is None:
                return
            self.buffer = self.buffer[consumed:]
            yield frame

    def receive(self, data: bytes) -> None:
        """Add what the socket gave to the buffer."""
        if not data:
            raise ConnectionError("broker closed the connection")
        self.buffer += data

    def frame(self) -> object:
        """The next frame, waiting for it (used while the socket still blocks)."""
        while True:
            for frame in self.frames():
                return frame
            self.receive(self.sock.recv(65536))

    def expect(self, kind: type) -> object:
        frame = self.frame()
        method = getattr(frame, "method", None)
        if not isinstance(method, kind):
            raise RuntimeError(f"expected {kind.__name__}, got {frame!r}")
        return method

    def open(self) -> int:
        self.sock.sendall(b"AMQP\x00\x00\x09\x01")
        self.expect(pika.spec.Connection.Start)
        self.send(
            0,
            pika.spec.Connection.StartOk(
                client_properties={"product": "raw-ceiling"},
                mechanism="PLAIN",
                response=f"\0{self.user}\0{self.password}",
            ),
        )
        tune = self.expect(pika.spec.Connection.Tune)
        frame_max = tune.frame_max  # type: ignore[attr-defined]
        self.send(0, pika.spec.Connection.TuneOk(tune.channel_max, frame_max, 0))  # type: ignore[attr-defined]
        self.send(0, pika.spec.Connection.Open(self.vhost))
        self.expect(pika.spec.Connection.OpenOk)
        self.send(1, pika.spec.Channel.Open())
        self.expect(pika.spec.Channel.OpenOk)
        self.send(1, pika.spec.Confirm.Select())
        self.expect(pika.spec.Confirm.SelectOk)
        return int(frame_max)


def raw_confirmed_seconds(url: str, queue: str, count: int, body: bytes, window: int = 0) -> float:
    """Seconds from the first byte written to the ack of the last message.

    ``window`` bounds how many messages are unconfirmed at once, as ``max_in_flight`` does for
    the Publisher (0: no bound, everything is written as fast as the socket takes it).
    """
    conn = _Conn(url)
    try:
        frame_max = conn.open()
        parts: list[bytes | memoryview] = []
        ends: list[int] = []  # byte offset just past each message
        size = 0
        for _ in range(count):
            mark = len(parts)
            publish_frames(1, build_message("", queue, body), None, frame_max, parts)
            size += sum(len(p) for p in parts[mark:])
            ends.append(size)
        data = memoryview(b"".join(parts))
        sock = conn.sock
        sock.setblocking(False)
        selector = selectors.DefaultSelector()
        both = selectors.EVENT_READ | selectors.EVENT_WRITE
        selector.register(sock, both)
        events_now = both
        sent = 0
        confirmed = 0
        started = time.perf_counter()
        while confirmed < count:
            allowed = ends[min(count, confirmed + window) - 1] if window else len(data)
            wanted = both if sent < allowed else selectors.EVENT_READ
            if wanted != events_now:
                selector.modify(sock, wanted)
                events_now = wanted
            for _key, events in selector.select():
                if events & selectors.EVENT_WRITE and sent < allowed:
                    with contextlib.suppress(BlockingIOError):
                        sent += sock.send(data[sent : min(allowed, sent + (1 << 20))])
                if events & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    conn.receive(chunk)
                    for frame in conn.frames():
                        method = getattr(frame, "method", None)
                        if isinstance(method, pika.spec.Basic.Nack):
                            raise RuntimeError(f"nack for {method.delivery_tag}")
                        if isinstance(method, pika.spec.Basic.Ack):
                            confirmed = max(confirmed, method.delivery_tag)
                        elif isinstance(method, pika.spec.Channel.Close):
                            raise RuntimeError(f"channel closed: {method}")
        return time.perf_counter() - started
    finally:
        conn.sock.close()
