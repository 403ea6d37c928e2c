"""Fixtures of the spool tests: spools that are closed after the test, messages to put in them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reliable_amqp._spool import Spool


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
