"""MCP connections over /mcp belong to the key that opened them, and the sandboxes MCP makes do
not pile up: they expire soon when idle, and a full quota says what to do in MCP's terms.
Driven with the real `mcp` SDK client against a real server."""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server, leftovers, make_server

IDLE_S = 10  # long enough for CAP one-shot clients to start on a busy machine before any expires
CAP = 3


@pytest.fixture(scope="module")
def mcp_server() -> Iterator[Server]:
    srv = make_server(mcp_idle_timeout_s=IDLE_S, max_sessions_per_key=CAP, reap_interval_s=1)
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@asynccontextmanager
async def connected(server: Server, key: str = KEY_A) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
        transport = streamable_http_client(f"{server.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy") as client:
            yield client


def text_of(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def sessions(server: Server, key: str = KEY_A) -> list[dict[str, Any]]:
    with server.client(key) as api:
        listed: list[dict[str, Any]] = api.get("/v1/sessions").json()
        return listed


def end_all(server: Server, key: str) -> None:
    with server.client(key) as api:
        for s in api.get("/v1/sessions").json():
            api.delete(f"/v1/sessions/{s['id']}")


async def test_another_key_cannot_end_or_use_a_connection(mcp_server: Server) -> None:
    end_all(mcp_server, KEY_A)
    async with httpx.AsyncClient(base_url=mcp_server.url, timeout=60) as http:
        mine = await _open(http, KEY_A)
        assert "isError" in (await _call(http, mine, "kept = 41")).text
        assert len(sessions(mcp_server)) == 1
        stranger = {**mine, "Authorization": f"Bearer {KEY_B}"}
        for method in ("DELETE", "POST", "GET"):
            body = _message("tools/list", {}) if method == "POST" else None
            response = await http.request(method, "/mcp", headers=stranger, json=body)
            assert response.status_code == 404, (method, response.text)
        # A's connection and its sandbox live on.
        assert "[result]\\n42" in (await _call(http, mine, "kept + 1")).text
        assert len(sessions(mcp_server)) == 1
        ended = await http.delete("/mcp", headers=mine)
        assert ended.status_code == 200, ended.text
        assert sessions(mcp_server) == []


async def test_a_call_longer_than_the_idle_timeout_keeps_its_connections_session(
    mcp_server: Server,
) -> None:
    """A call running past the connection's idle timeout (it is busy, not idle): the next call
    on the connection finds the same session, not a new one."""
    end_all(mcp_server, KEY_A)
    async with httpx.AsyncClient(base_url=mcp_server.url, timeout=120) as http:
        mine = await _open(http, KEY_A)
        await _call(http, mine, "kept = 41")
        await _call(http, mine, f"import time; time.sleep({IDLE_S + 2})")
        assert "[result]\\n42" in (await _call(http, mine, "kept + 1")).text
        assert len(sessions(mcp_server)) == 1
        assert (await http.delete("/mcp", headers=mine)).status_code == 200


async def test_a_connectionless_request_naming_anothers_connection_touches_nothing(
    mcp_server: Server,
) -> None:
    """The 2026-07-28 protocol has no connections: an `Mcp-Session-Id` it carries is checked
    by no transport, so it is not taken as one (another key's request naming A's connection
    gets a session of its own, and A's connection keeps its session)."""
    end_all(mcp_server, KEY_A)
    end_all(mcp_server, KEY_B)
    async with httpx.AsyncClient(base_url=mcp_server.url, timeout=120) as http:
        mine = await _open(http, KEY_A)
        await _call(http, mine, "kept = 41")
        meta = {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientInfo": {"name": "other", "version": "1"},
            "io.modelcontextprotocol/clientCapabilities": {},
        }
        params = {"name": "code_interpreter", "arguments": {"code": "1 + 1"}, "_meta": meta}
        headers = {
            "Authorization": f"Bearer {KEY_B}",
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
            "Mcp-Protocol-Version": "2026-07-28",
            "Mcp-Session-Id": mine["Mcp-Session-Id"],
            "Mcp-Method": "tools/call",
            "Mcp-Name": "code_interpreter",
        }
        other = await http.post("/mcp", json=_message("tools/call", params, id=5), headers=headers)
        assert other.status_code == 200 and "2" in other.text, other.text
        assert "[result]\\n42" in (await _call(http, mine, "kept + 1")).text
        assert "notice" not in (await _call(http, mine, "kept")).text
        assert (await http.delete("/mcp", headers=mine)).status_code == 200
    end_all(mcp_server, KEY_B)


def _message(method: str, params: dict[str, Any], id: int | None = 1) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    return {**message, "id": id} if id is not None else message


async def _open(http: httpx.AsyncClient, key: str) -> dict[str, str]:
    """Initialize an MCP connection; the headers that continue it."""
    headers = {
        "Authorization": f"Bearer {key}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    init = {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "one-shot", "version": "1"},
    }
    opened = await http.post("/mcp", json=_message("initialize", init), headers=headers)
    assert opened.status_code == 200, opened.text
    headers |= {
        "Mcp-Session-Id": opened.headers["mcp-session-id"],
        "Mcp-Protocol-Version": "2025-06-18",
    }
    note = _message("notifications/initialized", {}, id=None)
    assert (await http.post("/mcp", json=note, headers=headers)).status_code == 202
    return headers


async def _call(http: httpx.AsyncClient, headers: dict[str, str], code: str) -> httpx.Response:
    params = {"name": "code_interpreter", "arguments": {"code": code}}
    called = await http.post("/mcp", json=_message("tools/call", params, id=2), headers=headers)
    assert called.status_code == 200, called.text
    return called


async def test_one_shot_clients_expire_and_the_quota_says_what_to_do(mcp_server: Server) -> None:
    end_all(mcp_server, KEY_A)
    # One-shot clients that never send DELETE (the SDK's own client does, on exit).
    for n in range(CAP):
        await _one_shot_without_goodbye(mcp_server, f"n = {n}")
    assert len(sessions(mcp_server)) == CAP
    async with connected(mcp_server) as client:
        full = await client.call_tool("code_interpreter", {"code": "1"})
    message = text_of(full)
    assert full.is_error
    for needed in ("reuse", "DELETE /v1/sessions/", f"{IDLE_S:g} s"):
        assert needed in message, message
    assert all(s["id"] in message for s in sessions(mcp_server)), message
    # MCP-made sessions expire after their own, short idle time: the quota frees itself.
    assert all(s["idle_expires_in_s"] <= IDLE_S for s in sessions(mcp_server))
    assert _emptied(mcp_server, within_s=IDLE_S + 30)
    async with connected(mcp_server) as client:
        ok = await client.call_tool("code_interpreter", {"code": "6 * 7"})
        assert "[result]\n42" in text_of(ok), text_of(ok)


def _emptied(server: Server, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while sessions(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    return sessions(server) == []


async def _one_shot_without_goodbye(server: Server, code: str) -> None:
    """Initialize, call the tool once, and leave without DELETE, as raw HTTP clients do."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        await _call(http, await _open(http, KEY_A), code)
