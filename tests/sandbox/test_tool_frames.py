"""The host-tool channel's frame parser refuses what is not exactly a call, typed, whatever the
sandbox sends: nothing it parses can raise anything but FrameRefused."""

from __future__ import annotations

import json

import pytest

from sandbox.frames import MAX_DEPTH, FrameRefused, parse_call

pytestmark = pytest.mark.unit


def test_a_call_is_read() -> None:
    body = json.dumps({"id": 7, "tool": "lookup", "arguments": {"q": [1, {"a": "]]]"}]}})
    assert parse_call(body.encode()) == (7, "lookup", {"q": [1, {"a": "]]]"}]})


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_a_frame_nested_too_deeply_is_refused_not_a_recursion_error(depth: int) -> None:
    arguments = "[" * depth + "]" * depth
    body = f'{{"id": 1, "tool": "a", "arguments": {{"x": {arguments}}}}}'.encode()
    with pytest.raises(FrameRefused, match="nested more than"):
        parse_call(body)


def test_arguments_as_deep_as_allowed_still_pass() -> None:
    inner = MAX_DEPTH - 2  # the frame's object and the arguments' object are two levels
    body = f'{{"id": 1, "tool": "a", "arguments": {{"x": {"[" * inner}{"]" * inner}}}}}'
    assert parse_call(body.encode())[1] == "a"


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe", b"[]", b'{"id": 1}', b'{"id": true, "tool": "a", "arguments": {}}',
     b'{"id": 1, "tool": "", "arguments": {}}', b'{"id": 1, "tool": "a", "arguments": []}'],
)  # fmt: skip
def test_what_is_not_a_call_is_refused(body: bytes) -> None:
    with pytest.raises(FrameRefused):
        parse_call(body)
