"""An approval asked of an MCP client's user through one replica, answered through the other:
two real `serve` processes sharing a real Redis, the real `mcp` client behind a load balancer
that sends the client's answers (its JSON-RPC responses) to the replica that did not ask. The
answer reaches the question (mcp_front/http.py: kept in the store for the asking replica, which
hands it to its own transport)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.orchestrator.governance.test_approvals import TOOLS
from tests.orchestrator.governance.test_approvals_mcp import SEND, User, text_of
from tests.orchestrator.mcp_front.replicas import two_replicas
from tests.orchestrator.service.conftest import KEY_A, Server


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[tuple[Server, Server]]:
    with two_replicas(redis_url, host_tools=json.dumps(TOOLS), approval_timeout_s=60) as made:
        yield made


class AnswersToTheOther(httpx2.AsyncBaseTransport):
    """A load balancer without stickiness: the client's answers go to `other`, the rest to
    `asking`; what went where is kept."""

    def __init__(self, asking: int, other: int) -> None:
        self.asking, self.other = asking, other
        self.answers_sent = 0
        self._inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = self.asking
        if request.method == "POST":
            body = await request.aread()
            message = json.loads(body) if body else None
            if isinstance(message, dict) and "method" not in message and "id" in message:
                port, self.answers_sent = self.other, self.answers_sent + 1
        request.url = request.url.copy_with(port=port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_an_answer_sent_through_the_other_replica_reaches_the_question(
    replicas: tuple[Server, Server],
) -> None:
    a, b = replicas
    user = User("accept", {"approve": True, "reason": "through b"})
    balancer = AnswersToTheOther(_port(a), _port(b))
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx2.AsyncClient(headers=headers, transport=balancer, timeout=120) as http:
        transport = streamable_http_client(f"{a.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy", elicitation_callback=user) as client:
            result = await client.call_tool("code_interpreter", {"code": SEND})
    text = text_of(result)
    assert len(user.asked) == 1 and balancer.answers_sent == 1
    assert not result.is_error, text
    assert "'sent 3 to bob'" in text and "approved by mcp: through b" in text, text


def _port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])
