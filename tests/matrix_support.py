"""Shared between the matrix tests and their conftest: where leg headlines are collected."""

from __future__ import annotations

import pytest

#: one line per leg run ("matrix py3.10: python 3.10.13, pika 1.4.4, ...: 136 passed in 75 s")
SUMMARY = pytest.StashKey[list[str]]()
