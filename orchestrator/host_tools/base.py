"""A host tool: a name, a description, a JSON schema for its arguments, and an async call.

Every source (Python callables, HTTP endpoints, an MCP server's tools) comes down to this, so the
channel that serves sandboxed code treats them alike: check the arguments against `parameters`,
then `await tool.call(arguments)` within the time limit.
"""

from __future__ import annotations

import keyword
import re
from functools import cached_property
from typing import Any

from jsonschema import Draft202012Validator  # type: ignore[import-untyped]
from jsonschema.exceptions import SchemaError  # type: ignore[import-untyped]
from pydantic import BaseModel, ConfigDict, Field, field_validator

# Names the kernel-side module keeps for itself: a tool cannot shadow them.
RESERVED_NAMES = frozenset(
    {
        "sync", "ToolError", "ToolArgumentError", "ToolNotAllowed", "ToolTimeout",
        "ToolTooLarge", "ToolFailed", "ToolChannelError", "ToolDenied",
    }
)  # fmt: skip
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


class ToolInputError(ValueError):
    """The arguments passed the schema but the tool could not take them (sent as invalid)."""


class HostToolError(Exception):
    """A tool failed in a way its caller should read: the message is all the sandbox sees."""


def check_tool_name(name: str) -> str:
    """A tool becomes a Python function in the sandbox: its name must be one."""
    if not _NAME.match(name) or keyword.iskeyword(name) or name in RESERVED_NAMES:
        raise ValueError(
            f"tool name {name!r} is not usable: it must be a Python identifier (letters, digits, "
            f"underscores, a letter first, at most 64), not a keyword, and not one of "
            f"{', '.join(sorted(RESERVED_NAMES))}"
        )
    return name


def safe_tool_name(raw: str) -> str:
    """The nearest usable name for a foreign one (an MCP tool's `get-weather` -> `get_weather`)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", raw).strip("_") or "tool"
    if not name[0].isalpha():
        name = f"t_{name}"
    if keyword.iskeyword(name) or name in RESERVED_NAMES:
        name = f"{name}_"
    return name[:64]


class HostTool(BaseModel):
    """A tool sandboxed code may call. Subclasses implement `call`."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    name: str = Field(description="The function's name in the sandbox (a Python identifier).")
    description: str = Field("", description="What the model reads: the docstring.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema of the arguments object; checked on the host before each call.",
    )
    returns: dict[str, Any] | None = Field(None, description="JSON schema of the result, if known.")
    timeout_s: float | None = Field(
        None, gt=0, description="Time limit of one call; the service's default when unset."
    )
    requires_approval: bool = Field(
        False,
        description="Every call waits for a human to approve it (or deny it) before it runs; "
        "no answer within the service's approval_timeout_s is a denial.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_tool_name(value)

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as exc:
            raise ValueError(f"the parameters are not a valid JSON schema: {exc.message}") from None
        if value.get("type", "object") != "object":
            raise ValueError("the parameters schema must describe an object (type: object)")
        return value

    @cached_property
    def validator(self) -> Any:
        return Draft202012Validator(self.parameters)

    @property
    def summary(self) -> str:
        """The description's first line, for listings."""
        return self.description.strip().split("\n", 1)[0].strip()

    def argument_errors(self, arguments: Any) -> list[str]:
        """What is wrong with `arguments` for this tool's schema; empty when nothing is."""
        problems = []
        for error in sorted(self.validator.iter_errors(arguments), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in error.absolute_path)
            problems.append(f"{where}: {error.message}" if where else error.message)
        return problems

    async def call(self, arguments: dict[str, Any]) -> Any:
        """Run the tool with arguments that passed the schema; return a JSON-able value."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release what the tool holds (a client, a connection)."""
