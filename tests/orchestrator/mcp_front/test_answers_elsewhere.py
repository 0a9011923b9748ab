"""An approval asked of an MCP client's user through one replica, answered through the other:
two real `serve` processes sharing a real Redis, the real `mcp` client behind a load balancer
that sends the client's answers (its JSON-RPC responses) to the replica that did not ask. The
answer reaches the question (mcp_front/http.py: kept in the store for the asking replica, which
hands it to its own transport)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Iterator

import httpx2
import pytest
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client
from mcp_types import ElicitRequestParams, ElicitResult, RequestId

from tests.orchestrator.governance.test_approvals import TOOLS
from tests.orchestrator.governance.test_approvals_mcp import DENIABLE, SEND, User, text_of
from tests.orchestrator.mcp_front.replicas import two_replicas
from tests.orchestrator.service.conftest import KEY_A, Server


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[tuple[Server, Server]]:
    with two_replicas(redis_url, host_tools=json.dumps(TOOLS), approval_timeout_s=60) as made:
        yield made


class Balancer(httpx2.AsyncBaseTransport):
    """A load balancer without stickiness: each request to the port `route` picks from its
    body (b"" but for a POST); what went where is counted by port."""

    def __init__(self, route: Callable[[bytes], int]) -> None:
        self.route = route
        self.sent: Counter[int] = Counter()
        self._inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread() if request.method == "POST" else b""
        port = self.route(body)
        self.sent[port] += 1
        request.url = request.url.copy_with(port=port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _is_answer(body: bytes) -> bool:
    message = json.loads(body) if body else None
    return isinstance(message, dict) and "method" not in message and "id" in message


async def test_an_answer_sent_through_the_other_replica_reaches_the_question(
    replicas: tuple[Server, Server],
) -> None:
    a, b = replicas
    user = User("accept", {"approve": True, "reason": "through b"})
    # The client's answers go to B, everything else to A.
    balancer = Balancer(lambda body: _port(b) if _is_answer(body) else _port(a))
    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx2.AsyncClient(headers=headers, transport=balancer, timeout=120) as http:
        transport = streamable_http_client(f"{a.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy", elicitation_callback=user) as client:
            result = await client.call_tool("code_interpreter", {"code": SEND})
    text = text_of(result)
    assert len(user.asked) == 1 and balancer.sent[_port(b)] == 1
    assert not result.is_error, text
    assert "'sent 3 to bob'" in text and "approved by mcp: through b" in text, text


def _port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


class Decider:
    """A user who approves what pays bob and denies what pays eve, keeping each question's id."""

    def __init__(self) -> None:
        self.ids: dict[str, RequestId] = {}

    async def __call__(
        self, context: ClientRequestContext, params: ElicitRequestParams
    ) -> ElicitResult:
        who = "bob" if "'bob'" in params.message else "eve"
        self.ids[who] = context.request_id
        return ElicitResult(action="accept", content={"approve": who == "bob", "reason": who})


async def test_two_questions_at_once_through_both_replicas_get_their_own_answers(
    replicas: tuple[Server, Server],
) -> None:
    """One connection, two calls at once: one through A (its session there), one through B (a
    session of B's): each replica asks its own approval, every answer goes through A. Each
    question is answered by its own answer: the replica that continues a connection numbers its
    questions apart from the one that opened it."""
    a, b = replicas
    with b.client() as api:
        made = api.post("/v1/sessions", json={"tools": ["send_money"]})
        assert made.status_code in (200, 201), made.text
        on_b = made.json()["id"]
    user = Decider()

    def eve_to_b(body: bytes) -> int:
        """Calls that pay eve go to B; every answer and everything else to A."""
        return _port(b) if b"eve" in body and b"tools/call" in body else _port(a)

    headers = {"Authorization": f"Bearer {KEY_A}"}
    async with httpx2.AsyncClient(
        headers=headers, transport=Balancer(eve_to_b), timeout=120
    ) as http:
        transport = streamable_http_client(f"{a.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy", elicitation_callback=user) as client:
            paid, refused = await asyncio.gather(
                client.call_tool("code_interpreter", {"code": SEND}),
                client.call_tool("code_interpreter", {"code": DENIABLE, "session_id": on_b}),
            )
    assert "'sent 3 to bob'" in text_of(paid), text_of(paid)
    assert "DENIED send_money was denied by mcp: eve" in text_of(refused), text_of(refused)
    assert user.ids["bob"] != user.ids["eve"], user.ids
    with b.client() as api:
        assert api.delete(f"/v1/sessions/{on_b}").status_code == 204
