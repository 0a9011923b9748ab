"""The nesting measure against a plain reference, on hand-made and random inputs."""

from __future__ import annotations

import json
import random

import pytest

from sandbox.json_depth import nests_deeper_than

pytestmark = pytest.mark.unit


def reference_depth(text: bytes) -> int:
    """Deepest nesting of brackets outside strings: a byte-by-byte scan."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        char = chr(byte)
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def nested(depth: int) -> object:
    value: object = 1
    for level in range(depth):
        value = [value, {"k": "]]]"}] if level % 2 else {"a": value, "s": '[[["\\"{'}
    return value


@pytest.mark.parametrize("depth", [0, 1, 2, 63, 64, 65, 200, 30_000])
def test_exact_at_the_limit(depth: int) -> None:
    body = b"[" * depth + b"]" * depth
    assert nests_deeper_than(body, 64) is (depth > 64)


def test_brackets_in_strings_are_text() -> None:
    body = json.dumps({"code": "[" * 10_000 + '\\"' + "{" * 10_000}).encode()
    assert not nests_deeper_than(body, 4)
    assert not nests_deeper_than(b"", 4) and not nests_deeper_than(b"plain text", 4)


def test_unclosed_openers_are_too_deep() -> None:
    assert nests_deeper_than(b'{"path":' + b"{" * 30_000, 64)
    assert nests_deeper_than(b"[" * 65, 64)
    assert not nests_deeper_than(b"[1, 2", 64)


def test_an_unterminated_string_costs_no_backtracking() -> None:
    assert not nests_deeper_than(b'"' + b'\\"' * 2_000_000, 64)  # linear: returns at once


def test_random_documents_agree_with_the_reference() -> None:
    rng = random.Random(13)
    for _ in range(300):
        depth = rng.randint(0, 80)
        value = nested(depth)
        for _ in range(rng.randint(0, 3)):
            value = [value, nested(rng.randint(0, depth))] if rng.random() < 0.5 else value
        body = json.dumps(value).encode()
        expected = reference_depth(body)
        for limit in (expected - 1, expected, expected + 1):
            if limit >= 1:
                assert nests_deeper_than(body, limit) is (expected > limit), (limit, body[:80])


def test_json_lines_are_measured_line_by_line() -> None:
    lines = b"\n".join(json.dumps(nested(10)).encode() for _ in range(100))
    assert not nests_deeper_than(lines, 10) and nests_deeper_than(lines, 9)
