"""The host-tool channel's wire format, shared by whoever listens on a sandbox's channel socket:
the service itself (orchestrator/host_tools/channel.py) or, in cluster mode, the session's
actor on the sandbox's node (sandbox/backends/ray_cluster/node_tool_relay.py).

Both ways: a 4-byte big-endian length, then that many bytes of JSON.
    sandbox -> host   {"id": 7, "tool": "get_expenses", "arguments": {"member_id": "m1"},
                       "origin": "exec-3f2a..."}
    host -> sandbox   {"id": 7, "result": ...}
                  or  {"id": 7, "error": {"type": "timeout", "message": "..."}}
`origin` (optional, a short string or null) names the execution, command, background process or
terminal that started the calling thread or process (sandbox/host_channel.py, TOOL_ORIGIN_ENV).
A frame over the size cap, one begun and not finished in time, or one that is not exactly a
call is refused, and the connection closed: what a sandbox sends is never held unbounded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, NamedTuple

from sandbox.json_depth import nests_deeper_than

MESSAGE_CHARS = 2000  # an error message is for reading, not for carrying data
MAX_CONNECTIONS = 16  # per session: a kernel, its subprocesses
FRAME_TIMEOUT_S = 10.0  # a frame begun must end within this: no half-sent frames held
HEADER_BYTES = 4
# Deeper arguments than any tool takes: measured before parsing, since Python's parser raises
# RecursionError (not a ValueError) on a frame nested some thousands of levels deep.
MAX_DEPTH = 64
MAX_ORIGIN_CHARS = 128
_CALL_KEYS = {"id", "tool", "arguments"}

CallId = int | str


class CallFrame(NamedTuple):
    """One call, as the sandbox sent it."""

    id: CallId
    tool: str
    arguments: dict[str, Any]
    origin: str | None  # what started the caller (None: the frame did not say)


class FrameRefused(Exception):
    """The peer sent something that is not a call frame: the connection ends."""


async def read_frame(
    reader: asyncio.StreamReader, *, max_bytes: int, timeout_s: float
) -> bytes | None:
    """The body of the next frame; None when the peer closed between frames. A frame over
    `max_bytes`, truncated, or not whole within `timeout_s` of its start is refused."""
    try:
        head = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameRefused("a truncated frame") from None
        return None  # a normal end
    size = int.from_bytes(head, "big")
    if size > max_bytes:
        raise FrameRefused(f"a call of {size} bytes is over the limit of {max_bytes}")
    try:
        async with asyncio.timeout(timeout_s):
            return await reader.readexactly(size)
    except TimeoutError:
        raise FrameRefused("a frame that did not arrive whole in time") from None
    except asyncio.IncompleteReadError:
        raise FrameRefused("a truncated frame") from None


async def write_frame(writer: asyncio.StreamWriter, lock: asyncio.Lock, body: bytes) -> None:
    """Send one frame; `lock` keeps frames of answers finishing at once from interleaving."""
    async with lock:
        writer.write(len(body).to_bytes(HEADER_BYTES, "big") + body)
        await writer.drain()


def parse_call(body: bytes) -> tuple[CallId, str, dict[str, Any]]:
    """A call frame, exactly: its id, tool name and arguments; anything else is refused."""
    call = parse_call_frame(body)
    return call.id, call.tool, call.arguments


def parse_call_frame(body: bytes) -> CallFrame:
    """A call frame, exactly, with its origin; anything else is refused."""
    if nests_deeper_than(body, MAX_DEPTH):
        raise FrameRefused(f"a frame nested more than {MAX_DEPTH} levels deep")
    try:
        frame = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise FrameRefused("a frame that is not JSON") from None
    if not isinstance(frame, dict) or set(frame) not in (_CALL_KEYS, _CALL_KEYS | {"origin"}):
        raise FrameRefused("a frame that is not {id, tool, arguments[, origin]}")
    call_id, name, arguments = frame["id"], frame["tool"], frame["arguments"]
    valid_id = (isinstance(call_id, int) and not isinstance(call_id, bool) and call_id >= 0) or (
        isinstance(call_id, str) and 0 < len(call_id) <= 64
    )
    if not valid_id:
        raise FrameRefused("a call id that is not a small number or short string")
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise FrameRefused("a tool name that is not a short string")
    if not isinstance(arguments, dict):
        raise FrameRefused("arguments that are not an object")
    origin = frame.get("origin")
    if origin is not None and not (isinstance(origin, str) and 0 < len(origin) <= MAX_ORIGIN_CHARS):
        raise FrameRefused("an origin that is not a short string")
    return CallFrame(call_id, name, arguments, origin)


def error_frame(call_id: CallId | None, kind: str, message: str) -> bytes:
    """An answer that says a call failed: `kind` is what the kernel's module raises by."""
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS] + " [...]"
    return json.dumps({"id": call_id, "error": {"type": kind, "message": message}}).encode()


def refusal_frame(why: str) -> bytes:
    """The last frame of a connection that is being closed, saying why."""
    return error_frame(None, "refused", f"the host tool channel refused the connection: {why}")
