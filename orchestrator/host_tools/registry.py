"""The tools this orchestrator can offer to sandboxed code, by name; each session picks some.

registry = ToolRegistry()
registry.add_function(get_expenses)                   # a Python callable, sync or async
registry.add(HttpTool(name=..., url=..., parameters=...))
registry.add_mcp_server(McpServerConfig(command="my-mcp-server"))   # connected on start()
app = create_app(settings, tools=registry)
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from orchestrator.host_tools.base import HostTool
from orchestrator.host_tools.http import HttpTool
from orchestrator.host_tools.mcp_tool_source import McpConnection
from orchestrator.host_tools.python import function_tool
from orchestrator.host_tools.settings import HostToolsSettings, McpServerConfig

log = logging.getLogger(__name__)


class UnknownTools(ValueError):
    """Names that are not registered."""


class ToolRegistry:
    def __init__(self, tools: Iterable[HostTool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, HostTool] = {}
        self._mcp_configs: list[McpServerConfig] = []
        self._mcp: list[McpConnection] = []
        for tool in tools:
            self.add(tool)

    # --- registering -----------------------------------------------------------------------

    def add(self, tool: HostTool | Callable[..., Any]) -> HostTool:
        """Register a HostTool, or a Python callable made into one."""
        if not isinstance(tool, HostTool):
            tool = function_tool(tool)
        if tool.name in self._tools:
            raise ValueError(f"a host tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def add_function(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
        requires_approval: bool = False,
    ) -> HostTool:
        """Register a Python callable; `requires_approval`: each call waits for a human."""
        return self.add(
            function_tool(
                fn,
                name=name,
                description=description,
                timeout_s=timeout_s,
                requires_approval=requires_approval,
            )
        )

    def add_mcp_server(self, config: McpServerConfig) -> None:
        """Connect to this MCP server on `start()` and register its tools."""
        self._mcp_configs.append(config)

    def configure(self, settings: HostToolsSettings) -> None:
        """Register what the settings name: import paths, HTTP tools, MCP servers."""
        for path in settings.python:
            for tool in _imported(path):
                self.add(tool)
        for http in settings.http:
            self.add(HttpTool(**http.model_dump()))
        for server in settings.mcp:
            self.add_mcp_server(server)

    # --- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the MCP servers (all at once) and register their tools."""
        pending, self._mcp_configs = self._mcp_configs, []
        connections = [McpConnection(config) for config in pending]
        results = await asyncio.gather(*(c.start() for c in connections), return_exceptions=True)
        self._mcp += connections
        for config, result in zip(pending, results, strict=True):
            if isinstance(result, BaseException):
                await self.close()
                raise result
            for tool in result:
                self.add(tool)
            log.info("MCP server %r: %d tools", config.name, len(result))

    async def close(self) -> None:
        for connection in self._mcp:
            await connection.close()
        self._mcp = []
        for tool in self._tools.values():
            await tool.aclose()

    # --- reading ---------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> HostTool:
        return self._tools[name]

    def select(self, names: Iterable[str]) -> dict[str, HostTool]:
        """The tools of these names, in order; unknown names are refused all together."""
        wanted = list(dict.fromkeys(names))
        missing = [n for n in wanted if n not in self._tools]
        if missing:
            known = ", ".join(self._tools) or "none"
            raise UnknownTools(
                f"no host tool named {', '.join(repr(m) for m in missing)}; registered: {known}"
            )
        return {n: self._tools[n] for n in wanted}


def _imported(path: str) -> list[HostTool | Callable[..., Any]]:
    """'package.module:attribute' -> the callables or tools it names (one, or a list)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"host tool {path!r}: write it as 'package.module:function'")
    if os.getcwd() not in sys.path:  # as uvicorn does: the directory the service runs in
        sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    items = list(target) if isinstance(target, list | tuple) else [target]
    for item in items:
        if not isinstance(item, HostTool) and not callable(item):
            raise ValueError(f"host tool {path!r}: {item!r} is neither callable nor a HostTool")
    return items
