"""Host tools from an MCP server the orchestrator connects to (stdio command or streamable
HTTP), with the official `mcp` client. The connection stays open for the orchestrator's life,
held by a task of its own: the SDK's client must be entered and left by the same task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent, Tool
from pydantic import PrivateAttr

from orchestrator.host_tools.base import HostTool, HostToolError, safe_tool_name
from orchestrator.host_tools.settings import McpServerConfig

log = logging.getLogger(__name__)


class McpConnection:
    """One MCP server, connected until `close`."""

    def __init__(self, config: McpServerConfig) -> None:
        self.config = config
        self.client: Client | None = None
        self._ready: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 60.0) -> list[McpTool]:
        """Connect, list the tools, and return them as host tools."""
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.ensure_future(self._hold())
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except BaseException:
            await self.close()
            raise
        return await self._tools()

    async def _hold(self) -> None:
        cfg = self.config
        server: StdioServerParameters | str
        if cfg.command is not None:
            server = StdioServerParameters(
                command=cfg.command, args=cfg.args, env=cfg.env, cwd=cfg.cwd
            )
        else:
            assert cfg.url is not None
            server = cfg.url
        assert self._ready is not None
        try:
            async with Client(server) as client:
                self.client = client
                self._ready.set_result(None)
                await self._stop.wait()
        except Exception as exc:
            if not self._ready.done():
                self._ready.set_exception(
                    HostToolError(f"cannot connect to the MCP server {cfg.name!r}: {exc}")
                )
            else:
                log.warning("the MCP server %r went away: %s", cfg.name, exc)
        finally:
            self.client = None

    async def _tools(self) -> list[McpTool]:
        assert self.client is not None
        listed: list[Tool] = []
        cursor: str | None = None
        for _ in range(100):  # a server that pages forever cannot hang us
            page = await self.client.list_tools(cursor=cursor)
            listed += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        wanted = set(self.config.tools) if self.config.tools is not None else None
        tools = []
        for remote in listed:
            if wanted is not None and remote.name not in wanted:
                continue
            tool = McpTool(
                name=safe_tool_name(self.config.prefix + remote.name),
                description=remote.description or remote.title or "",
                parameters=remote.input_schema,
                returns=_unwrapped_output(remote.output_schema),
                timeout_s=self.config.timeout_s,
                requires_approval=self._requires_approval(remote.name),
            )
            tool._connection = self
            tool._remote_name = remote.name
            tool._unwrap = _wraps_result(remote.output_schema)
            tools.append(tool)
        return tools

    def _requires_approval(self, remote_name: str) -> bool:
        wanted = self.config.requires_approval
        return wanted if isinstance(wanted, bool) else remote_name in wanted

    async def call(self, name: str, arguments: dict[str, Any], *, unwrap: bool = False) -> Any:
        if self.client is None:
            raise HostToolError(f"the MCP server {self.config.name!r} is not connected")
        try:
            result = await self.client.call_tool(name, arguments)
        except MCPError as exc:
            raise HostToolError(f"the MCP server refused the call: {exc.error.message}") from None
        return _result_value(result, unwrap)

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 10)
            self._task = None


class McpTool(HostTool):
    """A host tool that calls a tool of an MCP server."""

    _connection: McpConnection = PrivateAttr()
    _remote_name: str = PrivateAttr()
    _unwrap: bool = PrivateAttr(default=False)

    async def call(self, arguments: dict[str, Any]) -> Any:
        return await self._connection.call(self._remote_name, arguments, unwrap=self._unwrap)


def _wraps_result(schema: dict[str, Any] | None) -> bool:
    """MCP servers put a function's plain return value under a lone `result` key."""
    return bool(schema) and set((schema or {}).get("properties", {})) == {"result"}


def _unwrapped_output(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema and _wraps_result(schema):
        inner = dict(schema["properties"]["result"])
        inner.pop("title", None)
        return inner
    return schema


def _result_value(result: CallToolResult, unwrap: bool) -> Any:
    """What the sandboxed code gets: the structured result if any, else the text."""
    texts = [block.text for block in result.content if isinstance(block, TextContent)]
    if result.is_error:
        raise HostToolError("\n".join(texts) or "the MCP tool failed")
    structured = result.structured_content
    if structured is not None:
        if unwrap and isinstance(structured, dict) and set(structured) == {"result"}:
            return structured["result"]
        return structured
    if len(texts) == len(result.content):
        return "\n".join(texts)
    return [block.model_dump(mode="json", exclude_none=True) for block in result.content]
