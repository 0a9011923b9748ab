"""The queue host tool calls wait in until the service takes and answers them
(sandbox/tool_call_queue.py): bounded, timed, each answered once. Real asyncio, no service."""

from __future__ import annotations

import asyncio
import json

import pytest

from code_interpreter_wire.errors import SandboxClosed
from sandbox.frames import FrameRefused
from sandbox.tool_call_queue import CALLS_PER_POLL, MAX_UNANSWERED, ToolCallQueue

pytestmark = pytest.mark.unit


def call(n: int, tool: str = "add") -> bytes:
    return json.dumps({"id": n, "tool": tool, "arguments": {"a": n}}).encode()


def manifest(timeout_s: float, max_result_bytes: int = 1000) -> bytes:
    tools = [{"name": "add", "timeout_s": timeout_s}]
    body = {"timeout_s": timeout_s, "max_call_bytes": 4096, "max_result_bytes": max_result_bytes}
    return json.dumps({**body, "tools": tools}).encode()


class Caller:
    """Where answers go: kept, in the order they came."""

    def __init__(self) -> None:
        self.answers: list[dict[str, object]] = []
        self.keys: set[str] = set()
        self.arrived = asyncio.Event()

    async def deliver(self, body: bytes) -> None:
        self.answers.append(json.loads(body))
        self.arrived.set()


async def test_calls_are_taken_oldest_first_and_each_answered_once() -> None:
    queue, caller = ToolCallQueue(), Caller()
    for n in range(CALLS_PER_POLL + 2):
        assert queue.offer(call(n), caller.deliver, caller.keys) is None
    first = await queue.next_calls(1)
    assert [json.loads(body)["id"] for _, body in first] == list(range(CALLS_PER_POLL))
    rest = await queue.next_calls(1)
    assert len(rest) == 2
    key = first[0][0]
    await queue.answer(key, b'{"id": 0, "result": 1}')
    await queue.answer(key, b'{"id": 0, "result": 2}')  # a second answer: dropped
    assert caller.answers == [{"id": 0, "result": 1}]
    assert await queue.next_calls(0) == []


async def test_past_the_cap_a_call_is_busy_and_a_caller_gone_frees_its_calls() -> None:
    queue, caller = ToolCallQueue(), Caller()
    for n in range(MAX_UNANSWERED):
        assert queue.offer(call(n), caller.deliver, caller.keys) is None
    busy = queue.offer(call(99), caller.deliver, caller.keys)
    assert busy is not None and json.loads(busy)["error"]["type"] == "busy"
    queue.forget_group(caller.keys)
    assert not caller.keys and queue.offer(call(100), caller.deliver, caller.keys) is None
    with pytest.raises(FrameRefused):
        queue.offer(b'{"not": "a call"}', caller.deliver, caller.keys)


async def test_a_call_nobody_answers_times_out_and_a_large_answer_is_refused() -> None:
    queue, caller = ToolCallQueue(), Caller()
    queue.set_manifest(manifest(0.05, max_result_bytes=100))
    queue.offer(call(1), caller.deliver, caller.keys)
    await asyncio.wait_for(caller.arrived.wait(), 5)
    assert caller.answers[0]["error"]["type"] == "timeout"  # type: ignore[index]
    caller.arrived.clear()
    queue.set_manifest(manifest(30, max_result_bytes=100))
    queue.offer(call(2), caller.deliver, caller.keys)
    [(key, _)] = await queue.next_calls(1)
    await queue.answer(key, json.dumps({"id": 2, "result": "x" * 200}).encode())
    assert caller.answers[1]["error"]["type"] == "too_large"  # type: ignore[index]


async def test_once_closed_nothing_is_taken_or_kept() -> None:
    queue, caller = ToolCallQueue(), Caller()
    queue.offer(call(1), caller.deliver, caller.keys)
    await queue.close()
    with pytest.raises(SandboxClosed):
        await queue.next_calls(1)
    refused = queue.offer(call(2), caller.deliver, caller.keys)
    assert refused is not None and json.loads(refused)["error"]["type"] == "refused"
