"""Where host tools come from: Python callables (schemas from signatures and docstrings), HTTP
endpoints, and an MCP server's tools (stdio and streamable HTTP). Host side only."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from orchestrator.host_tools import (
    HostToolError,
    HttpTool,
    McpServerConfig,
    ToolInputError,
    ToolRegistry,
    UnknownTools,
    function_tool,
)
from orchestrator.host_tools.describe import call_signature
from tests.orchestrator.service.conftest import free_port

MCP_SERVER = str(Path(__file__).with_name("example_mcp_tool_server.py"))


class Expense(BaseModel):
    amount: float
    category: str


def google(member_id: str, since: str | None = None, limit: int = 100) -> list[Expense]:
    """Expense records of one team member.

    Args:
        member_id: The member's id, from get_team_members.
        since: Only records on or after this ISO date.
        limit: At most this many records.

    Returns:
        The records, newest first.
    """
    return [Expense(amount=limit, category=member_id)]


async def numpy_style(kind: Literal["a", "b"], /, scale: float = 1.0) -> dict[str, float]:
    """Summarise a kind.

    Parameters
    ----------
    kind : str
        Which kind of thing.
    scale : float
        A factor.
    """
    await asyncio.sleep(0)
    return {kind: scale}


def sphinx_style(text: str, upper: bool = False) -> str:
    """Echo a text.

    :param text: What to echo.
    :param upper: In capitals.
    """
    return text.upper() if upper else text


async def test_schemas_come_from_signatures_and_docstrings() -> None:
    tool = function_tool(google)
    assert tool.name == "google" and tool.description == "Expense records of one team member."
    assert tool.parameters == {
        "type": "object",
        "properties": {
            "member_id": {
                "type": "string",
                "description": "The member's id, from get_team_members.",
            },
            "since": {
                "anyOf": [{"type": "string"}, {"type": "null"}],
                "default": None,
                "description": "Only records on or after this ISO date.",
            },
            "limit": {
                "type": "integer",
                "default": 100,
                "description": "At most this many records.",
            },
        },
        "required": ["member_id"],
        "additionalProperties": False,
    }
    assert tool.returns is not None and tool.returns["type"] == "array"
    assert tool.returns["description"] == "The records, newest first."
    assert call_signature(tool) == "google(member_id, *, since=None, limit=100)"
    assert await tool.call({"member_id": "m1", "limit": 3}) == [Expense(amount=3, category="m1")]

    tool = function_tool(numpy_style)  # async, positional-only, Literal
    props = tool.parameters["properties"]
    assert props["kind"] == {
        "enum": ["a", "b"],
        "type": "string",
        "description": "Which kind of thing.",
    }
    assert props["scale"]["description"] == "A factor."
    assert await tool.call({"kind": "b", "scale": 2}) == {"b": 2.0}

    tool = function_tool(sphinx_style, name="echo_text", description="Say it back.", timeout_s=3)
    assert (tool.name, tool.description, tool.timeout_s) == ("echo_text", "Say it back.", 3)
    assert tool.parameters["properties"]["upper"]["description"] == "In capitals."
    assert await tool.call({"text": "hi", "upper": True}) == "HI"


async def test_schema_checks_and_refusals() -> None:
    tool = function_tool(google)
    assert tool.argument_errors({"member_id": "m"}) == []
    assert tool.argument_errors({"member_id": 1, "extra": 2}) == [
        "Additional properties are not allowed ('extra' was unexpected)",
        "member_id: 1 is not of type 'string'",
    ]
    with pytest.raises(ToolInputError, match="limit"):  # past the schema, pydantic still checks
        await tool.call({"member_id": "m", "limit": "many"})

    def star(*args: int) -> None: ...

    with pytest.raises(ValueError, match="cannot be described"):
        function_tool(star)
    for bad in ("class", "sync", "ToolError", "has-dash", "_private", "x" * 65):
        with pytest.raises(ValueError, match="not usable"):
            function_tool(sphinx_style, name=bad)
    registry = ToolRegistry([google])
    with pytest.raises(ValueError, match="already registered"):
        registry.add(google)
    with pytest.raises(UnknownTools, match="'nope'"):
        registry.select(["google", "nope"])


@pytest.fixture(scope="module")
def http_endpoint() -> Iterator[str]:
    """A stdlib HTTP server on 127.0.0.1: /convert answers JSON, /text text, /fail 500."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None: ...

        def _answer(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/convert":
                answer = {"amount": sent["amount"] * 2, "key": self.headers.get("X-Key")}
                self._answer(200, json.dumps(answer).encode(), "application/json")
            else:
                self._answer(500, b"the ledger is down", "text/plain")

        def do_GET(self) -> None:
            self._answer(200, f"you asked {self.path}".encode(), "text/plain")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


async def test_http_tools(http_endpoint: str) -> None:
    schema = {"type": "object", "properties": {"amount": {"type": "number"}}}
    convert = HttpTool(
        name="convert",
        description="Convert an amount.",
        url=f"{http_endpoint}/convert",
        headers={"X-Key": "k-123"},
        parameters=schema,
    )
    assert await convert.call({"amount": 2.5}) == {"amount": 5.0, "key": "k-123"}
    text = HttpTool(name="text", url=f"{http_endpoint}/text", method="GET", parameters=schema)
    assert await text.call({"amount": 3}) == "you asked /text?amount=3"
    fail = HttpTool(name="fail", url=f"{http_endpoint}/fail", parameters=schema)
    with pytest.raises(HostToolError, match="HTTP 500: the ledger is down"):
        await fail.call({"amount": 1})
    small = HttpTool(name="small", url=f"{http_endpoint}/convert", max_response_bytes=5)
    with pytest.raises(HostToolError, match="over 5 bytes"):
        await small.call({"amount": 1})
    for tool in (convert, text, fail, small):
        await tool.aclose()


async def _check_mcp_registry(registry: ToolRegistry) -> None:
    await registry.start()
    try:
        assert {"m_add", "m_word_count", "m_shout"} <= set(registry.names)
        add = registry.get("m_add")
        assert add.description.startswith("Add two integers.")
        assert add.parameters["required"] == ["a", "b"]
        assert add.returns == {"type": "integer"}  # MCP's {"result": ...} wrapper is undone
        assert await add.call({"a": 2, "b": 3}) == 5
        assert await registry.get("m_word_count").call({"text": "a b c"}) == {"words": 3}
        with pytest.raises(HostToolError, match="Error executing tool fail"):
            await registry.get("m_fail").call({"message": "no"})
    finally:
        await registry.close()


async def test_mcp_server_over_stdio() -> None:
    registry = ToolRegistry()
    registry.add_mcp_server(
        McpServerConfig(name="test", command=sys.executable, args=[MCP_SERVER], prefix="m_")
    )
    await _check_mcp_registry(registry)
    only = ToolRegistry()
    only.add_mcp_server(
        McpServerConfig(command=sys.executable, args=[MCP_SERVER], tools=["shout"], prefix="m_")
    )
    await only.start()
    try:
        assert only.names == ["m_shout"]
        assert await only.get("m_shout").call({"text": "hi"}) == "HI"
    finally:
        await only.close()


@pytest.fixture
def mcp_http_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, MCP_SERVER, "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(url)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


async def test_mcp_server_over_streamable_http(mcp_http_url: str) -> None:
    registry = ToolRegistry()
    registry.add_mcp_server(McpServerConfig(url=mcp_http_url, prefix="m_"))
    await _check_mcp_registry(registry)


async def test_an_unreachable_mcp_server_fails_start() -> None:
    registry = ToolRegistry()
    registry.add_mcp_server(McpServerConfig(name="gone", command="/nonexistent/mcp-server"))
    with pytest.raises(HostToolError, match="cannot connect to the MCP server 'gone'"):
        await registry.start()
