"""dir(reliable_amqp) lists the public names only (issue 20): no typing helpers."""

from __future__ import annotations

import reliable_amqp


def test_dir_lists_the_public_names_and_nothing_of_typing() -> None:
    names = dir(reliable_amqp)
    assert "Any" not in names and "TYPE_CHECKING" not in names
    assert set(names) == {*reliable_amqp.__all__, "AsyncPublisher"}
    for name in names:  # each one is there, AsyncPublisher loaded on first use
        assert getattr(reliable_amqp, name) is not None
