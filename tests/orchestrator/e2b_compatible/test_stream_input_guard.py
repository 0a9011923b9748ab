"""A Connect client stream (StreamInput: input typed into a process) is passed through as it
comes, not read whole first; each message is still measured before any parser sees it. Hostile
messages in the stream are refused with the reason, and the server carries on."""

from __future__ import annotations

import json
import struct

import httpx
from e2b_code_interpreter import Sandbox

from tests.orchestrator.service.conftest import Server

DEEP = b'{"start":' + b"[" * 30_000 + b"]" * 30_000 + b"}"


def _envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def _end_error(body: bytes) -> dict[str, str]:
    """The error of a Connect stream's end message (the envelope flagged 0x02)."""
    while body:
        flags, size = struct.unpack(">BI", body[:5])
        payload, body = body[5 : 5 + size], body[5 + size :]
        if flags & 0x02:
            error: dict[str, str] = json.loads(payload)["error"]
            return error
    raise AssertionError("no end message")


def _stream_input(server: Server, sbx: Sandbox, body: bytes) -> httpx.Response:
    headers = {
        "content-type": "application/connect+json",
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Access-Token": sbx._envd_access_token or "",
    }
    return httpx.post(
        server.url + "/process.Process/StreamInput", content=body, headers=headers, timeout=60
    )


def test_a_deep_message_inside_the_stream_is_refused(e2b_env: Server, sbx: Sandbox) -> None:
    cat = sbx.commands.run("cat", background=True, stdin=True)
    start = json.dumps({"start": {"process": {"pid": cat.pid}}}).encode()
    data = json.dumps({"data": {"input": {"stdin": "aGkK"}}}).encode()  # "hi\n"
    answer = _stream_input(e2b_env, sbx, _envelope(start) + _envelope(data) + _envelope(DEEP))
    error = _end_error(answer.content)
    assert error["code"] == "invalid_argument" and "nested deeper than" in error["message"]
    huge = struct.pack(">BI", 0, 64 << 20)  # announces a 64 MiB message
    error = _end_error(_stream_input(e2b_env, sbx, huge + b"{").content)
    assert error["code"] == "resource_exhausted"
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "hi\n"  # what came before the bad message was delivered
    assert sbx.run_code("1 + 1").text == "2"
