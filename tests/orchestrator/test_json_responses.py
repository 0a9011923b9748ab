"""A large execution is encoded in many small native calls, never one: one call over 60 MB holds
the interpreter's lock (and so the event loop) for the whole of it, even from a thread. Checked
by what each call is given, not by timing, and the bytes must be the plain encoding's."""

from __future__ import annotations

import json

import pytest

from code_interpreter_wire.rest import ExecutionRecord
from orchestrator import json_responses
from orchestrator.json_responses import json_response

pytestmark = pytest.mark.unit

# ~60 MB of JSON: characters that need escaping or are not ASCII cost an encoder most.
STDOUT = ("é" + '"' + "\n") * (1 << 18) * 40


async def test_a_large_answer_is_encoded_a_small_piece_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes: list[int] = []
    encode = json_responses._encode_small

    def recorded(value: object) -> str:
        text = encode(value)
        sizes.append(len(text))
        return text

    monkeypatch.setattr(json_responses, "_encode_small", recorded)
    record = ExecutionRecord(
        stdout=STDOUT,
        results=[{"json": {"k": ["x" * 1000] * 5000}, "extra": {"y" * 600_000: ""}}],
        session_id="s-1",
        execution_id="e-1",
    )
    response = await json_response(record)
    assert json.loads(response.body) == json.loads(record.model_dump_json())
    assert len(sizes) > 100  # many calls...
    assert max(sizes) <= 2 * json_responses._PIECE + 2  # ...each of a bounded size


async def test_a_small_answer_is_the_same_json() -> None:
    record = ExecutionRecord(stdout="hi", session_id="s-1", execution_id="e-1")
    response = await json_response(record)
    assert response.media_type == "application/json"
    assert json.loads(response.body) == json.loads(record.model_dump_json())
