"""Approval through MCP elicitation: while an MCP client's `code_interpreter` call runs, what
waits for a human is asked of the client's user (the real `mcp` client, with an elicitation
callback, over the service's streamable HTTP); a client that cannot be asked leaves the request
to the API."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult, ElicitRequestParams, ElicitResult, TextContent

from tests.orchestrator.governance.conftest import add_key_to
from tests.orchestrator.governance.test_approvals import ADMIN_KEY, TOOLS
from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

SEND = "import host_tools\nhost_tools.sync.send_money('bob', 3)"
DENIABLE = (
    "import host_tools\n"
    "try:\n"
    "    host_tools.sync.send_money('eve', 9)\n"
    "except host_tools.ToolDenied as e:\n"
    "    print('DENIED', e)\n"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(
        backends="local",
        default_backend="local",
        host_tools=json.dumps(TOOLS),
        admin_keys=ADMIN_KEY,
        approval_timeout_s=60,
    ).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


class User:
    """The person behind an MCP client: answers each elicitation as told, keeps what it read."""

    def __init__(self, action: str, content: dict[str, Any] | None = None) -> None:
        self.action = action
        self.content = content
        self.asked: list[str] = []

    async def __call__(
        self, context: ClientRequestContext, params: ElicitRequestParams
    ) -> ElicitResult:
        self.asked.append(params.message)
        schema = params.requested_schema  # type: ignore[union-attr]
        assert set(schema["properties"]) == {"approve", "reason"}
        assert schema["properties"]["approve"]["type"] == "boolean"
        return ElicitResult(action=self.action, content=self.content)  # type: ignore[arg-type]


@asynccontextmanager
async def mcp_client(server: Server, key: str, user: User | None) -> AsyncIterator[Client]:
    # A call's response stream may be quiet a while (a sandbox starting, a human deciding).
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        transport = streamable_http_client(f"{server.url}/mcp", http_client=http)
        async with Client(transport, mode="legacy", elicitation_callback=user) as client:
            yield client


def text_of(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


async def test_the_client_user_approves_and_denies(server: Server) -> None:
    yes = User("accept", {"approve": True, "reason": "ok by me"})
    async with mcp_client(server, KEY_A, yes) as client:
        result = await client.call_tool("code_interpreter", {"code": SEND})
        text = text_of(result)
        assert not result.is_error, text
        assert "'sent 3 to bob'" in text
        assert "[approval] send_money waited" in text and "approved by mcp: ok by me" in text
        [asked] = yes.asked
        assert "send_money" in asked and '"to":"bob"' in asked and SEND in asked

    no = User("accept", {"approve": False, "reason": "not eve"})
    async with mcp_client(server, KEY_A, no) as client:
        text = text_of(await client.call_tool("code_interpreter", {"code": DENIABLE}))
        assert "DENIED send_money was denied by mcp: not eve" in text, text

    declined = User("decline")
    async with mcp_client(server, KEY_A, declined) as client:
        text = text_of(await client.call_tool("code_interpreter", {"code": DENIABLE}))
        assert "DENIED send_money was denied by mcp: the MCP client's user declined" in text, text


async def test_a_client_without_elicitation_leaves_it_to_the_api(server: Server) -> None:
    async with mcp_client(server, KEY_A, None) as client:
        call = asyncio.ensure_future(client.call_tool("code_interpreter", {"code": SEND}))
        async with httpx2.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
        ) as admin:
            deadline = time.monotonic() + 60
            while True:
                pending = (await admin.get("/v1/approvals", params={"state": "pending"})).json()
                mine = [r for r in pending if r["subject"] == "send_money"]
                if mine:
                    break
                assert time.monotonic() < deadline and not call.done()
                await asyncio.sleep(0.05)
            answered = await admin.post(
                f"/v1/approvals/{mine[0]['id']}", json={"decision": "approve"}
            )
            assert answered.status_code == 200, answered.text
        text = text_of(await asyncio.wait_for(call, 60))
        assert "'sent 3 to bob'" in text and "[approval] send_money waited" in text


async def test_a_gated_execution_is_asked_of_the_client_user(server: Server) -> None:
    """A key whose policy gates every execution, and may answer its own requests: its MCP
    client's user is asked before the code runs."""
    name = f"erin-{uuid.uuid4().hex[:6]}"
    key = add_key_to(server, name, "--approve-executions", "--self-approve")
    user = User("accept", {"approve": True, "reason": ""})
    async with mcp_client(server, key, user) as client:
        result = await client.call_tool("code_interpreter", {"code": "6 * 7"})
        text = text_of(result)
        assert "[result]\n42" in text and "[approval] execution waited" in text, text
        assert "approved by mcp" in text
        [asked] = user.asked
        assert "wants to run this code" in asked and "6 * 7" in asked
