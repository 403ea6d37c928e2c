"""Fixtures of the spool tests: spools that are closed after the test, messages to put in them,
both publishers, a proxy in front of the broker."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.fixtures import ProxyFactory
from harness.proxy import TcpProxy
from reliable_amqp import Publisher
from reliable_amqp._spool import Spool
from support.spool import Kind, SpooledAsync


@pytest.fixture
def open_spool(tmp_path: Path) -> Iterator[Callable[..., Spool]]:
    """``open_spool(**options)`` opens a spool in ``tmp_path / "spool"`` (or ``directory=``)."""
    opened: list[Spool] = []

    def factory(directory: Path | None = None, **options: Any) -> Spool:
        spool = Spool(directory or tmp_path / "spool", **options)
        opened.append(spool)
        return spool

    yield factory
    for spool in opened:
        with contextlib.suppress(Exception):
            spool.close(timeout=10)


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> Kind:
    """The publisher class under test: Publisher, or AsyncPublisher behind a blocking driver."""
    return Publisher if request.param == "sync" else SpooledAsync


@pytest.fixture
def proxy(make_proxy: ProxyFactory) -> TcpProxy:
    """A proxy in front of the shared broker (its URL is ``proxy.url()``)."""
    return make_proxy()
