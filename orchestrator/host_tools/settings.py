"""How host tools are configured: the `host_tools` table of the service's settings.

    [host_tools]
    python = ["myapp.tools:get_expenses", "myapp.tools:TOOLS"]   # callables, or lists of them
    session_default = ["get_expenses"]     # for sessions the code_interpreter tool creates
    call_timeout_s = 30

    [[host_tools.http]]
    name = "convert_currency"
    description = "Convert an amount between currencies."
    url = "https://rates.example.com/convert"
    parameters = { type = "object", properties = { amount = { type = "number" } } }
    requires_approval = false             # true: each call waits for a human's yes

    [[host_tools.mcp]]
    name = "files"                         # a label for logs
    command = "npx"
    args = ["-y", "@modelcontextprotocol/server-filesystem", "/srv/data"]
    prefix = "fs_"                         # the tools become fs_read_file, ...

In the environment: CODE_INTERPRETER_HOST_TOOLS='{"python": ["myapp.tools:get_expenses"]}'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HttpToolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    url: str
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    headers: dict[str, str] = Field(default_factory=dict)
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema of the arguments.",
    )
    timeout_s: float | None = Field(None, gt=0)
    requires_approval: bool = Field(False, description="Every call waits for a human's yes.")


class McpServerConfig(BaseModel):
    """One MCP server: a command to run (stdio) or a streamable-HTTP URL."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("mcp", description="A label for logs and errors.")
    command: str | None = Field(None, description="Run this, speaking MCP over stdin/stdout.")
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] | None = Field(None, description="Extra environment of the command.")
    cwd: Path | None = None
    url: str | None = Field(None, description="A streamable-HTTP MCP endpoint instead.")
    prefix: str = Field("", description="Put before each tool's name, e.g. 'github_'.")
    tools: list[str] | None = Field(
        None, description="Only these of the server's tools (by their MCP names); all if unset."
    )
    timeout_s: float | None = Field(None, gt=0, description="Time limit of each call.")
    requires_approval: list[str] | bool = Field(
        False,
        description="Calls that wait for a human's yes: true for every tool of the server, or "
        "the tools named (by their MCP names).",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError(f"MCP server {self.name!r}: give either command or url, not both")
        return self


class HostToolsSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    python: list[str] = Field(
        default_factory=list,
        description="Callables by import path, 'package.module:attribute'; the attribute may "
        "also be a HostTool or a list of callables and HostTools.",
    )
    http: list[HttpToolConfig] = Field(default_factory=list)
    mcp: list[McpServerConfig] = Field(default_factory=list)
    session_default: list[str] = Field(
        default_factory=list,
        description="Tools of the sessions the code_interpreter tool creates on its own.",
    )
    call_timeout_s: float = Field(60.0, gt=0, description="Time limit of a call by default.")
    max_call_bytes: int = Field(1 << 20, ge=1024, description="Largest call frame (arguments).")
    max_result_bytes: int = Field(8 << 20, ge=1024, description="Largest result frame.")
    max_calls_in_flight: int = Field(
        64, ge=1, description="Calls one session may have running at once; more wait."
    )
