"""An MCP client (the real `mcp` SDK's) whose requests a load balancer moves from replica A to
replica B mid-connection: its session goes on through B with its variables, and closing the
client through B ends that session on every replica. The same cluster and replicas as
test_replicas.py (its fixtures)."""

from __future__ import annotations

import asyncio
import re

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, TextContent

from code_interpreter_wire.background_loop import run_sync
from tests.cluster.test_replicas import (  # noqa: F401  (fixtures)
    KEY_A,
    Replica,
    redis_url,
    replicas,
    store,
)
from tests.orchestrator.mcp_front.test_adoption import _Based
from tests.orchestrator.service.test_mcp_sessions import _message, _open


class _Balancer(httpx2.AsyncBaseTransport):
    """Sends each request to the replica the test names: a load balancer without stickiness."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.url = request.url.copy_with(port=self.port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _text(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def _through_both(a: Replica, b: Replica) -> str:
    balancer = _Balancer(a.port)
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx2.AsyncClient(headers=headers, transport=balancer, timeout=120) as http:
        transport = streamable_http_client(f"{a.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy") as client:
            first = await client.call_tool("code_interpreter", {"code": "kept = 41"})
            assert not first.is_error, _text(first)
            balancer.port = b.port  # from here on, every request goes to B
            second = await client.call_tool("code_interpreter", {"code": "kept + 1"})
            assert "[result]\n42" in _text(second), _text(second)
            [session_id] = set(re.findall(r"s-[0-9a-f]{24}", _text(first) + _text(second)))
        # Closing the client sent its DELETE through B.
    return session_id


@pytest.mark.cluster
def test_replica_mcp_connection_continues_through_the_other_replica(
    replicas: tuple[Replica, Replica],  # noqa: F811
) -> None:
    a, b = replicas
    session_id = run_sync(_through_both(a, b))
    served = b.log.read_text()  # B served the call and the close, which A's client made
    assert '"POST /mcp HTTP/1.1" 200' in served and '"DELETE /mcp HTTP/1.1" 200' in served
    for replica in (a, b):
        with replica.client() as api:
            gone = api.get(f"/v1/sessions/{session_id}")
        assert gone.status_code == 410 and "was deleted" in gone.text, gone.text


async def _first_calls_through_both(a: Replica, b: Replica) -> set[str]:
    """A connection opened through A whose first two calls go at once, one through each."""
    async with httpx.AsyncClient(timeout=120) as http:
        headers = await _open(_Based(http, a.url), KEY_A)  # type: ignore[arg-type]
        params = {"name": "code_interpreter", "arguments": {"code": "import os; os.getpid()"}}
        answers = await asyncio.gather(
            *(
                http.post(
                    f"{replica.url}/mcp",
                    json=_message("tools/call", params, id=10 + n),
                    headers=headers,
                )
                for n, replica in enumerate((a, b))
            )
        )
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
        pids = {re.findall(r"\[result\]\\n(\d+)", r.text)[0] for r in answers}
        sessions = set(re.findall(r"s-[0-9a-f]{24}", "".join(r.text for r in answers)))
        assert (await http.delete(f"{b.url}/mcp", headers=headers)).status_code == 200
    assert len(pids) == 1, pids  # one kernel answered both
    return sessions


@pytest.mark.cluster
def test_replica_mcp_first_calls_through_both_replicas_share_one_session(
    replicas: tuple[Replica, Replica],  # noqa: F811
) -> None:
    """Each replica starts a session for the connection's first call; the store keeps the one
    bound first, and the other replica ends its own and uses that one (nothing is left: the
    replicas fixture checks the store holds no session and no place at its end)."""
    a, b = replicas
    [session_id] = run_sync(_first_calls_through_both(a, b))
    for replica in (a, b):
        with replica.client() as api:
            assert api.get(f"/v1/sessions/{session_id}").status_code == 410
