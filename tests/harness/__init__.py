"""Fault-injection tools for the test suite: a disposable RabbitMQ node and a TCP proxy.

Pytest fixtures built on them live in ``harness.fixtures`` (kept out of this module so the tools
can be imported without pytest).
"""

from .node import BrokerCommandError, BrokerStartError, DisposableBroker
from .proxy import TcpProxy

__all__ = ["BrokerCommandError", "BrokerStartError", "DisposableBroker", "TcpProxy"]
