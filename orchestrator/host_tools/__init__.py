"""Host tools: functions of the host that sandboxed code can call (programmatic tool calling).

Register Python callables, HTTP endpoints and an MCP server's tools in a `ToolRegistry`; each
session names the ones its code may call; inside the kernel they are `import host_tools`.
See docs/programmatic-tool-calling.md.
"""

from orchestrator.host_tools.base import HostTool, HostToolError, ToolInputError
from orchestrator.host_tools.channel import ChannelLimits, ToolChannel
from orchestrator.host_tools.http import HttpTool
from orchestrator.host_tools.mcp_tool_source import McpConnection, McpTool
from orchestrator.host_tools.python import PythonTool, function_tool
from orchestrator.host_tools.registry import ToolRegistry, UnknownTools
from orchestrator.host_tools.settings import HostToolsSettings, HttpToolConfig, McpServerConfig

__all__ = [
    "ChannelLimits",
    "HostTool",
    "HostToolError",
    "HostToolsSettings",
    "HttpTool",
    "HttpToolConfig",
    "McpConnection",
    "McpServerConfig",
    "McpTool",
    "PythonTool",
    "ToolChannel",
    "ToolInputError",
    "ToolRegistry",
    "UnknownTools",
    "function_tool",
]
