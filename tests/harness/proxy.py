"""A loopback TCP proxy that can cut, stall or refuse connections on demand.

One background thread runs a selector loop over the listening socket and every proxied pair of
sockets; the public methods hand commands to that thread and wait until they took effect, so after
``cut()`` returns every connection is gone, and after ``stall()`` returns no byte moves any more.

Failure modes offered, and what a client sees:

- ``cut()``: both sockets of every pair are closed at once. By default with an RST (SO_LINGER 0),
  so the client's next read fails with ECONNRESET instead of a clean EOF; ``cut(reset=False)``
  closes with FIN and the client reads EOF. New connections keep being accepted.
- ``stall()``: nothing is read or written on any pair, old or new, and nothing is closed; only the
  peers' heartbeat timeouts can notice. ``resume()`` lets the traffic (and queued bytes) through.
- ``refuse()``: new connections are accepted and reset at once (a dead endpoint); ``accept()``
  ends that. Connections already proxied are untouched.

A connection the target refuses (the broker is down) is reset on the client side as well.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar, cast
from urllib.parse import quote

__all__ = ["TcpProxy"]

_T = TypeVar("_T")
_CHUNK = 65536
# Per direction: stop reading from a peer while this much is waiting to be written to the other.
_MAX_BUFFER = 1 << 20
_COMMAND_TIMEOUT = 10.0
_LINGER_RESET = struct.pack("ii", 1, 0)


@dataclass(eq=False)
class _Pair:
    """A client connection and its upstream connection, with the bytes in flight each way."""

    client: socket.socket
    upstream: socket.socket
    connected: bool = False
    to_upstream: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)
    client_eof: bool = False
    upstream_eof: bool = False
    upstream_shut: bool = False
    client_shut: bool = False
    registered: dict[socket.socket, int] = field(default_factory=dict)


class TcpProxy:
    """Forward 127.0.0.1:``port`` to ``(target_host, target_port)``, with fault switches.

    Usable as a context manager (``start()`` on enter, ``close()`` on exit).
    """

    def __init__(
        self, target_port: int, target_host: str = "127.0.0.1", listen_port: int = 0
    ) -> None:
        """Prepare a proxy to ``target_host:target_port``; ``listen_port=0`` picks a free port."""
        self.target: tuple[str, int] = (target_host, target_port)
        self._listen_port = listen_port
        self._port = 0
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pairs: set[_Pair] = set()
        self._stalled = False
        self._refusing = False
        self._stopping = False
        self._error: BaseException | None = None
        self._accepted = 0
        self._count_lock = threading.Lock()

    # -- public surface -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on (127.0.0.1); still known after ``close()``."""
        if not self._port:
            raise RuntimeError("the proxy is not started")
        return self._port

    def url(self, vhost: str = "/", user: str = "guest", password: str = "guest") -> str:
        """An AMQP URL that reaches the target through this proxy."""
        return f"amqp://{user}:{password}@127.0.0.1:{self.port}/{quote(vhost, safe='')}"

    @property
    def connection_count(self) -> int:
        """How many client connections are currently proxied (closed ones are not counted)."""
        with self._count_lock:
            return len(self._pairs)

    @property
    def accepted_count(self) -> int:
        """How many client connections were accepted since start, refused ones included."""
        with self._count_lock:
            return self._accepted

    @property
    def stalled(self) -> bool:
        """Whether traffic is currently held back by ``stall()``."""
        return self._stalled

    @property
    def refusing(self) -> bool:
        """Whether new connections are currently reset by ``refuse()``."""
        return self._refusing

    def start(self) -> TcpProxy:
        """Listen and start the forwarding thread. Returns self."""
        if self._thread is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self._listen_port))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._port = listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(
            target=self._run, name=f"TcpProxy-{self.port}->{self.target[1]}", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Reset every connection, stop listening and join the thread.

        Re-raises an unexpected error that ended the forwarding thread, so a broken proxy fails
        the test that used it rather than going unnoticed.
        """
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            self._stopping = True
            self._wake()
            thread.join(_COMMAND_TIMEOUT)
            if thread.is_alive():
                raise RuntimeError(f"{thread.name} did not stop")
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("the proxy thread failed") from error

    def cut(self, reset: bool = True) -> int:
        """Close both sides of every current connection at once; returns how many were cut.

        ``reset=True`` closes with RST (SO_LINGER 0), ``reset=False`` with a FIN.
        """

        def do() -> int:
            pairs = list(self._pairs)
            for pair in pairs:
                self._drop(pair, reset=reset)
            return len(pairs)

        return self._call(do)

    def stall(self) -> None:
        """Stop moving bytes both ways on existing and new connections, without closing any."""

        def do() -> None:
            self._stalled = True
            for pair in self._pairs:
                self._update(pair)

        self._call(do)

    def resume(self) -> None:
        """Undo ``stall()``: bytes held back flow again."""

        def do() -> None:
            self._stalled = False
            for pair in list(self._pairs):
                self._update(pair)

        self._call(do)

    def refuse(self) -> None:
        """Reset every new connection right after accepting it (existing ones are untouched)."""

        def do() -> None:
            self._refusing = True

        self._call(do)

    def accept(self) -> None:
        """Undo ``refuse()``: new connections are proxied again."""

        def do() -> None:
            self._refusing = False

        self._call(do)

    def wait_for_connections(self, count: int, timeout: float = 10.0) -> None:
        """Block until exactly ``count`` connections are proxied (e.g. a client reconnected)."""
        deadline = time.monotonic() + timeout
        while self.connection_count != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.connection_count} proxied connections, expected {count}")
            time.sleep(0.02)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TcpProxy 127.0.0.1:{self._port} -> {self.target[0]}:{self.target[1]}>"

    # -- command plumbing (caller threads) ------------------------------------------------------

    def _call(self, fn: Callable[[], _T]) -> _T:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the proxy is not running") from self._error
        command: _Command = _Command(fn)
        self._commands.put(command)
        self._wake()
        if not command.done.wait(_COMMAND_TIMEOUT):
            raise TimeoutError("the proxy thread did not answer")
        if command.error is not None:
            raise command.error
        return cast(_T, command.result)

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                self._wake_w.send(b"\0")

    # -- the forwarding thread ------------------------------------------------------------------

    def _run(self) -> None:
        selector = self._selector
        assert selector is not None
        try:
            while not self._stopping:
                for key, events in selector.select(timeout=1.0):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept_all()
                    elif sock is self._wake_r:
                        self._drain_wakeups()
                    else:
                        assert isinstance(sock, socket.socket)
                        self._on_ready(key.data, sock, events)
                self._run_commands()
        except BaseException as exc:
            self._error = exc
        finally:
            self._shutdown()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command.result = command.fn()
            except Exception as exc:
                command.error = exc
            command.done.set()

    def _drain_wakeups(self) -> None:
        assert self._wake_r is not None
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def _accept_all(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # Transient accept failures (ECONNABORTED, EMFILE) must not kill the proxy.
                if exc.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS):
                    return
                raise
            with self._count_lock:
                self._accepted += 1
            if self._refusing:
                _close(client, reset=True)
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(client, upstream)
            code = upstream.connect_ex(self.target)
            if code not in (0, errno.EINPROGRESS):
                _close(upstream, reset=True)
                _close(client, reset=True)
                continue
            pair.connected = code == 0
            with self._count_lock:
                self._pairs.add(pair)
            self._update(pair)

    def _on_ready(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        if pair not in self._pairs:
            return  # dropped earlier in this same round of events
        try:
            if sock is pair.upstream and not pair.connected:
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code != 0:
                    self._drop(pair, reset=True)  # the target is down: look like it to the client
                    return
                pair.connected = True
            elif not self._stalled:
                if events & selectors.EVENT_WRITE:
                    self._flush(pair, sock)
                if events & selectors.EVENT_READ:
                    self._read(pair, sock)
        except OSError:
            # ECONNRESET, EPIPE and friends: one side is gone, so the other gets a reset too.
            self._drop(pair, reset=True)
            return
        self._finish_half_closes(pair)
        if pair in self._pairs:
            self._update(pair)

    def _read(self, pair: _Pair, sock: socket.socket) -> None:
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        from_client = sock is pair.client
        if not data:
            if from_client:
                pair.client_eof = True
            else:
                pair.upstream_eof = True
            return
        (pair.to_upstream if from_client else pair.to_client).extend(data)
        # Write straight away rather than waiting for the next round of the loop.
        self._flush(pair, pair.upstream if from_client else pair.client)

    def _flush(self, pair: _Pair, sock: socket.socket) -> None:
        if sock is pair.upstream and not pair.connected:
            return
        buffer = pair.to_upstream if sock is pair.upstream else pair.to_client
        while buffer:
            try:
                sent = sock.send(buffer)
            except (BlockingIOError, InterruptedError):
                return
            del buffer[:sent]

    def _finish_half_closes(self, pair: _Pair) -> None:
        # Pass a FIN on once the bytes before it are delivered, so a clean close stays clean.
        if pair not in self._pairs:
            return
        if pair.client_eof and not pair.to_upstream and not pair.upstream_shut and pair.connected:
            _shutdown_write(pair.upstream)
            pair.upstream_shut = True
        if pair.upstream_eof and not pair.to_client and not pair.client_shut:
            _shutdown_write(pair.client)
            pair.client_shut = True
        if pair.upstream_shut and pair.client_shut:
            self._drop(pair, reset=False)

    def _update(self, pair: _Pair) -> None:
        """Register each socket of the pair for exactly the events it should wait for now."""
        assert self._selector is not None
        client_events = 0
        upstream_events = 0
        if not pair.connected:
            upstream_events = selectors.EVENT_WRITE  # completion of the non-blocking connect
        elif not self._stalled:
            if not pair.upstream_eof and len(pair.to_client) < _MAX_BUFFER:
                upstream_events |= selectors.EVENT_READ
            if pair.to_upstream:
                upstream_events |= selectors.EVENT_WRITE
        if not self._stalled:
            if not pair.client_eof and len(pair.to_upstream) < _MAX_BUFFER:
                client_events |= selectors.EVENT_READ
            if pair.to_client:
                client_events |= selectors.EVENT_WRITE
        for sock, events in ((pair.client, client_events), (pair.upstream, upstream_events)):
            current = pair.registered.get(sock, 0)
            if events == current:
                continue
            if current == 0:
                self._selector.register(sock, events, pair)
            elif events == 0:
                self._selector.unregister(sock)
            else:
                self._selector.modify(sock, events, pair)
            pair.registered[sock] = events

    def _drop(self, pair: _Pair, reset: bool) -> None:
        assert self._selector is not None
        with self._count_lock:
            self._pairs.discard(pair)
        for sock in (pair.client, pair.upstream):
            if pair.registered.pop(sock, 0):
                self._selector.unregister(sock)
            _close(sock, reset=reset)

    def _shutdown(self) -> None:
        for pair in list(self._pairs):
            with contextlib.suppress(Exception):
                self._drop(pair, reset=True)
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        if self._selector is not None:
            self._selector.close()
        # Whoever still waits on a command must not wait for the full timeout.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command.error = RuntimeError("the proxy was closed")
            command.done.set()


@dataclass(eq=False)
class _Command:
    fn: Callable[[], object]
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


def _shutdown_write(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def _close(sock: socket.socket, reset: bool) -> None:
    if reset:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()
