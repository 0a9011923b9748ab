"""The `code_interpreter` tool's and the `run_command` tool's definitions in each agent API's
format: what the model reads of them (their descriptions) and their argument schemas.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.network_policy import NO_NETWORK, NetworkPolicy
from code_interpreter_wire.tool_arguments import (
    SHELL_TOOL_NAME,
    TOOL_NAME,
    ShellToolArguments,
    ToolArguments,
)

# What the kernel has installed (the `kernel` extra), named in the description.
LIBRARIES = [
    "numpy", "pandas", "matplotlib", "scipy", "scikit-learn", "seaborn", "pillow", "openpyxl",
]  # fmt: skip


class ToolFormat(StrEnum):
    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC = "anthropic"
    MCP = "mcp"


_STATE_BY_ARGUMENT = (
    "State persists: pass the session_id from an earlier result to keep variables, imports "
    "and files; omit it to start a fresh session. "
)
_STATE_BOUND = "State persists between calls: variables, imports and files stay. "


def description(
    *,
    timeout_s: float,
    libraries: list[str],
    bound_session: bool = False,
    host_tools: Sequence[tuple[str, str]] = (),
    session_note: str = "",
    languages: Sequence[str] = (PYTHON,),
    network: NetworkPolicy = NO_NETWORK,
) -> str:
    """What the model reads. `bound_session`: the caller keeps one session per conversation
    (an agent framework's tool, an MCP connection), so the model need not pass session_id.
    `host_tools`: (call signature, summary) of each host tool the code may call.
    `session_note`: more on sessions, said right after how state persists.
    `languages`: those the sessions have (Python first), from the backend: listed when more.
    `network`: the sessions' network policy, told so the model knows whether to try."""
    return (
        "Run Python 3.11 code in a stateful, sandboxed Jupyter kernel and get back what it "
        "printed, the value of its last expression (as in a notebook), errors with tracebacks, "
        "and images (matplotlib figures shown with plt.show() or left as the last expression). "
        + languages_text(languages)
        + (_STATE_BOUND if bound_session else _STATE_BY_ARGUMENT)
        + (f"{session_note} " if session_note else "")
        + f"Installed: {', '.join(libraries)}. "
        "The working directory is /workspace: files the user uploaded are there, and files you "
        "save there (e.g. df.to_csv('out.csv')) can be downloaded by the user. "
        + network_text(network, "pip install and web requests")
        + f"Each call may run for up to {timeout_s:g} seconds; input() is not available."
        + host_tools_text(host_tools)
    )


def network_text(policy: NetworkPolicy, what: str) -> str:
    """What the model is told of the network: none, some hosts, or the internet."""
    if policy.mode == "none":
        return f"There is no network access: {what} fail. "
    if policy.mode == "any":
        where = "the internet (not private addresses)"
    else:
        where = f"only these hosts: {policy.describe(most=12)}"
    return (
        f"Network access goes through a proxy already set in the environment and reaches "
        f"{where}; a refused host answers 403 with the reason. pip install puts packages in "
        "the workspace. "
    )


def languages_text(languages: Sequence[str]) -> str:
    """The sentence that tells the model which other languages it may use; empty with none."""
    others = [name for name in languages if name != PYTHON]
    if not others:
        return ""
    return (
        f"Other languages: set language to one of {', '.join(others)} (python is the default). "
        "Each language has its own kernel, whose variables persist between its calls; all "
        "share the same files in /workspace. "
    )


def language_schema(languages: Sequence[str], *, nullable: bool = False) -> dict[str, Any]:
    """The `language` argument: one of the languages the sessions have (null too when
    `nullable`, as strict schemas spell an optional argument)."""
    names: list[Any] = list(languages)
    return {
        "type": ["string", "null"] if nullable else "string",
        "enum": [*names, None] if nullable else names,
        "description": f"The language of code: {', '.join(languages)}. Python if omitted.",
    }


def host_tools_text(tools: Sequence[tuple[str, str]]) -> str:
    """The paragraph that tells the model it can script the host's tools; empty without any."""
    if not tools:
        return ""
    listed = "\n".join(f"- {call}: {text}" if text else f"- {call}" for call, text in tools)
    return (
        "\nHost tools: the code can call these functions, which run on the host. "
        "`import host_tools`; each is async: `await host_tools.NAME(...)`, many at once with "
        "`await asyncio.gather(...)`; blocking: `host_tools.sync.NAME(...)`. "
        "`help(host_tools.NAME)` shows the parameters; failures raise host_tools.ToolError. "
        "To save context, call them from one program and print only what you need.\n" + listed
    )


# The code alone, for a caller that runs Python only (examples/agent_loop.py). Strict-mode
# valid (every property required, no others), as OpenAI's strict function calling wants.
CODE_ONLY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "Python code to run."}},
    "required": ["code"],
    "additionalProperties": False,
}


def code_only_schema(languages: Sequence[str] = (PYTHON,)) -> dict[str, Any]:
    """The arguments when the caller keeps the session (bound_session): the code and its
    language. Strict-mode valid (every property required, no others, the optional language
    nullable), as OpenAI's strict function calling wants."""
    return {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The code to run."},
            "language": language_schema(languages, nullable=True),
        },
        "required": ["code", "language"],
        "additionalProperties": False,
    }


def definitions(
    *,
    timeout_s: float,
    libraries: list[str],
    host_tools: Sequence[tuple[str, str]] = (),
    languages: Sequence[str] = (PYTHON,),
    network: NetworkPolicy = NO_NETWORK,
) -> dict[str, Any]:
    """The tool's definition in every supported format; `languages`: those its sessions have,
    `network`: their policy."""
    text = description(
        timeout_s=timeout_s,
        libraries=libraries,
        host_tools=host_tools,
        languages=languages,
        network=network,
    )
    schema = {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": ToolArguments.model_fields["code"].description,
            },
            "language": language_schema(languages),
            "session_id": {
                "type": "string",
                "description": ToolArguments.model_fields["session_id"].description,
            },
        },
        "required": ["code"],
        "additionalProperties": False,
    }
    return _in_every_format(TOOL_NAME, text, schema)


def _in_every_format(name: str, text: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "json_schema": schema,
        ToolFormat.OPENAI_CHAT: {
            "type": "function",
            "function": {"name": name, "description": text, "parameters": schema},
        },
        ToolFormat.OPENAI_RESPONSES: {
            "type": "function",
            "name": name,
            "description": text,
            "parameters": schema,
            "strict": False,
        },
        ToolFormat.ANTHROPIC: {"name": name, "description": text, "input_schema": schema},
        ToolFormat.MCP: {"name": name, "description": text, "inputSchema": schema},
    }


def shell_description(
    *,
    timeout_s: float,
    libraries: list[str],
    bound_session: bool = False,
    session_note: str = "",
    network: NetworkPolicy = NO_NETWORK,
) -> str:
    """What the model reads of `run_command`. `bound_session`, `session_note` and `network`: as
    for `description`."""
    state = (
        f"Files persist between calls, and {TOOL_NAME} works in the same session. "
        if bound_session
        else "Files persist: pass the session_id from an earlier result (of this tool or of "
        f"{TOOL_NAME}) to work in that session; omit it to start a fresh one. "
    )
    return (
        "Run a shell command line with bash (as `bash -l -c`) in the same sandbox as "
        f"{TOOL_NAME}: the same working directory (/workspace), files and Python (python3 has "
        f"{', '.join(libraries)}). Get back its exit code, stdout and stderr; long output is "
        "trimmed and the text says so: write it to a file and read parts of it with head, tail "
        "or grep. "
        + state
        + (f"{session_note} " if session_note else "")
        + network_text(network, "pip install, git clone and downloads")
        + "stdin is empty, so interactive programs (editors, pagers, prompts) cannot be used. "
        f"Each command may run for up to {timeout_s:g} seconds (less with timeout_s); then it "
        "is killed with everything it started."
    )


# The arguments when the caller keeps the session (bound_session): no session_id.
COMMAND_ONLY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {
            "type": "string",
            "description": ShellToolArguments.model_fields["command"].description,
        },
        "timeout_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": ShellToolArguments.model_fields["timeout_s"].description,
        },
    },
    "required": ["command"],
    "additionalProperties": False,
}


def shell_definitions(
    *, timeout_s: float, libraries: list[str], network: NetworkPolicy = NO_NETWORK
) -> dict[str, Any]:
    """`run_command`'s definition in every supported format."""
    text = shell_description(timeout_s=timeout_s, libraries=libraries, network=network)
    schema = {
        "type": "object",
        "properties": {
            **COMMAND_ONLY_SCHEMA["properties"],
            "session_id": {
                "type": "string",
                "description": ShellToolArguments.model_fields["session_id"].description,
            },
        },
        "required": ["command"],
        "additionalProperties": False,
    }
    return _in_every_format(SHELL_TOOL_NAME, text, schema)
