"""Small things said right (issue 33): articles in type names, the same words on both sides."""

from __future__ import annotations

import pytest

from reliable_amqp import InvalidMessage
from reliable_amqp._core.builder import build_message
from reliable_amqp._core.errors import a_type


def test_a_header_value_of_no_amqp_type_is_named_with_its_article() -> None:
    for value, named in ((object(), "an object"), ({1, 2}, "a set"), (Ellipsis, "an ellipsis")):
        with pytest.raises(InvalidMessage) as caught:
            build_message("", "q", b"", properties={"headers": {"x": value}})
        assert caught.value.problem.startswith(f"{named} has no AMQP field type"), caught.value
    assert a_type(1j) == "a complex"
