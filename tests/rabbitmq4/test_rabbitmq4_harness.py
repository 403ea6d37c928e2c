"""The RabbitMQ 4 node runs beside the machine's broker without touching it.

Its AMQP, distribution and epmd ports are its own; it registers with its own epmd, not the
machine's (4369); kill -9 and restart keep its durable queue; SIGSTOP freezes it (its port stays
open, nothing answers) and SIGCONT thaws it. About 10 s.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pika
import pytest

from harness.rabbitmq4 import Rabbitmq4Node, process_state, versions
from support.broker import AMQP_DEFAULT_PORT

pytestmark = [pytest.mark.broker, pytest.mark.faults]

MACHINE_PORTS = {AMQP_DEFAULT_PORT, AMQP_DEFAULT_PORT + 20000, 4369}  # AMQP, distribution, epmd


def _epmd_names(root: Path | None, port: int) -> str:
    if root is None:  # the machine's epmd
        epmd = sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"))[-1]
        cmd = [str(epmd)]
    else:
        epmd = sorted((root / "usr/lib/erlang").glob("erts-*/bin/epmd"))[-1]
        cmd = ["chroot", str(root), "/" + str(epmd.relative_to(root))]
    run = subprocess.run(
        [*cmd, "-port", str(port), "-names"], capture_output=True, text=True, check=False
    )
    return run.stdout


def _cluster_name(url: str) -> object:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        return connection._impl.server_properties.get("cluster_name")
    finally:
        connection.close()


def test_a_rabbitmq4_node_has_ports_and_epmd_of_its_own(amqp_url: str, rmq4: Rabbitmq4Node) -> None:
    assert versions()["rabbitmq-server"].startswith("4.")
    node = rmq4  # the directory's node (conftest.py), handed on running after the test
    try:
        ports = {node.port, node.dist_port, node.epmd_port}
        assert len(ports) == 3 and not ports & MACHINE_PORTS
        short = node.nodename.split("@")[0]
        assert f"name {short} at port {node.dist_port}" in _epmd_names(node.root, node.epmd_port)
        assert short not in _epmd_names(None, 4369)
        # The shared broker answers, and is another cluster than the node.
        assert _cluster_name(amqp_url) != _cluster_name(node.url)

        connection = pika.BlockingConnection(pika.URLParameters(node.url))
        connection.channel().queue_declare("kept", durable=True)
        connection.close()
        node.kill()
        node.start()
        connection = pika.BlockingConnection(pika.URLParameters(node.url))
        assert connection.channel().queue_declare("kept", passive=True).method.queue == "kept"
        connection.close()

        node.freeze()
        with socket.create_connection(("127.0.0.1", node.port), timeout=2) as sock:
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            sock.settimeout(1.0)
            try:  # the kernel accepted the connection; the frozen node says nothing
                answer = sock.recv(1)
            except TimeoutError:
                pass
            else:
                pid = node.pid
                state = Path(f"/proc/{pid}/status").read_text() if pid else "no process"
                pytest.fail(f"the frozen node answered {answer!r}; beam {pid}:\n{state}")
        node.thaw()
        connection = pika.BlockingConnection(pika.URLParameters(node.url))
        connection.close()
    finally:
        node.thaw()
        node.start()
        connection = pika.BlockingConnection(pika.URLParameters(node.url))
        connection.channel().queue_delete("kept")
        connection.close()


def test_a_freeze_stops_the_process_on_the_port_even_when_the_pid_file_names_another(
    rmq4: Rabbitmq4Node,
) -> None:
    """A pid file that names a live process other than the listener (the launcher, here) must
    not have that process stopped, nor pass for a freeze: the beam on the port is stopped."""
    node = rmq4
    pid_file = node.dir / "rabbit.pid"
    beam = node.pid
    assert beam is not None and node._proc is not None
    launcher = node._proc.pid
    pid_file.write_text(f"{launcher}\n")
    try:
        node.freeze()
        assert process_state(beam) == "T" and process_state(launcher) != "T"
        with socket.create_connection(("127.0.0.1", node.port), timeout=2) as sock:
            sock.sendall(b"AMQP\x00\x00\x09\x01")
            sock.settimeout(1.0)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        node.thaw()
        assert process_state(beam) != "T"
    finally:
        node.thaw()
        pid_file.write_text(f"{beam}\n")
    connection = pika.BlockingConnection(pika.URLParameters(node.url))
    connection.close()
