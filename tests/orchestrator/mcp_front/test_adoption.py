"""An MCP connection opened through one replica and continued through another, on two real
`serve` processes sharing a real Redis (their sessions on the local backend: the connection is
what moves here; tests/cluster/test_replicas.py moves a session's calls with it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.orchestrator.mcp_front.replicas import two_replicas
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server
from tests.orchestrator.service.test_mcp_sessions import _message, _open


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[tuple[Server, Server]]:
    with two_replicas(redis_url) as made:
        yield made


def _tools(response: httpx.Response) -> list[str]:
    body = response.text
    payload: dict[str, Any] = httpx.Response(200, content=body.split("data: ", 1)[-1]).json()
    return [tool["name"] for tool in payload["result"]["tools"]]


async def test_a_connection_opened_through_one_replica_goes_on_through_the_other(
    replicas: tuple[Server, Server],
) -> None:
    a, b = replicas
    async with httpx.AsyncClient(timeout=120) as http:
        headers = await _open_at(http, a)
        listed = await http.post(
            f"{b.url}/mcp", json=_message("tools/list", {}, id=3), headers=headers
        )
        assert listed.status_code == 200, listed.text
        assert "code_interpreter" in _tools(listed)
        # Its calls go on there, with the session the connection made there.
        assert "isError" in (await _call_at(http, b, headers, "kept = 41")).text
        assert "[result]\\n42" in (await _call_at(http, b, headers, "kept + 1")).text
        # Another key cannot take it over through either replica.
        stranger = {**headers, "Authorization": f"Bearer {KEY_B}"}
        for server in (a, b):
            refused = await http.post(
                f"{server.url}/mcp", json=_message("tools/list", {}), headers=stranger
            )
            assert refused.status_code == 404, refused.text
        [made] = _sessions(b)
        # Ended through B (its session with it): A, which opened it and still holds it,
        # refuses it too.
        ended = await http.delete(f"{b.url}/mcp", headers=headers)
        assert ended.status_code == 200, ended.text
        _assert_deleted(b, made)
        for server in (a, b):
            gone = await http.post(
                f"{server.url}/mcp", json=_message("tools/list", {}), headers=headers
            )
            assert gone.status_code == 404, gone.text


async def test_parallel_first_calls_on_an_adopted_connection_share_one_session(
    replicas: tuple[Server, Server],
) -> None:
    """Two first calls at once on a connection the replica adopts by them: one transport, one
    session. (Through two replicas at once: tests/cluster/test_replica_mcp.py.)"""
    a, b = replicas
    async with httpx.AsyncClient(timeout=120) as http:
        headers = await _open_at(http, a)

        first = await asyncio.gather(
            _call_at(http, b, headers, "import os; os.getpid()", request_id=11),
            _call_at(http, b, headers, "import os; os.getpid()", request_id=12),
        )
        pids = {r.text.split("[result]\\n", 1)[1].split("\\n", 1)[0] for r in first}
        assert len(pids) == 1, [r.text for r in first]  # one kernel answered both
        [made] = _sessions(b)
        ended = await http.delete(f"{b.url}/mcp", headers=headers)
        assert ended.status_code == 200, ended.text
        _assert_deleted(b, made)


def _sessions(server: Server) -> list[str]:
    """The ids of KEY_A's live sessions."""
    with server.client() as api:
        return [s["id"] for s in api.get("/v1/sessions").json()]


def _assert_deleted(server: Server, session_id: str) -> None:
    with server.client() as api:
        gone = api.get(f"/v1/sessions/{session_id}")
    assert gone.status_code == 410 and "was deleted" in gone.text, gone.text


async def _open_at(http: httpx.AsyncClient, server: Server) -> dict[str, str]:
    return await _open(_Based(http, server.url), KEY_A)  # type: ignore[arg-type]


async def _call_at(
    http: httpx.AsyncClient,
    server: Server,
    headers: dict[str, str],
    code: str,
    request_id: int = 2,
) -> httpx.Response:
    params = {"name": "code_interpreter", "arguments": {"code": code}}
    message = _message("tools/call", params, id=request_id)
    called = await http.post(f"{server.url}/mcp", json=message, headers=headers)
    assert called.status_code == 200, called.text
    return called


class _Based:
    """The shared client's `post` at one replica's address."""

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self._http, self._url = http, url

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self._http.post(f"{self._url}{path}", **kwargs)
