"""The arguments a model sends the `code_interpreter` tool and the `run_command` tool beside it:
their models, and the reading of a model's raw arguments, which explains a malformed call (so the
model can fix it) instead of failing it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TOOL_NAME = "code_interpreter"
SHELL_TOOL_NAME = "run_command"
_CODE_EXAMPLE = '{"code": "print(1 + 1)"}'
_SHELL_EXAMPLE = '{"command": "ls -la"}'


class ToolArguments(BaseModel):
    """What the model sends. Unknown extra fields are ignored; wrong types are explained."""

    model_config = ConfigDict(extra="ignore")

    code: str = Field(min_length=1, description="The code to run in the session's kernel.")
    session_id: str | None = Field(
        None,
        description="The session to run in, from an earlier result. Omit it to start a new "
        "session; pass it again to keep variables, imports and files.",
    )
    # Checked by the service, which names the languages there are: a wrong one is told.
    language: str | None = Field(None, max_length=100)


class ShellToolArguments(BaseModel):
    """What the model sends to `run_command`. Unknown extra fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    command: str = Field(
        min_length=1,
        description="A shell command line, run by bash in /workspace, e.g. `ls -la`, "
        "`grep -rn TODO .` or `python3 script.py`.",
    )
    session_id: str | None = Field(
        None,
        description="The session to run in, from an earlier result of this tool or of "
        f"{TOOL_NAME}. Omit it to start a new session; pass it again to keep working on the "
        "same files.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds after which the command is killed, with everything it started. "
        "At most the tool's own limit, which also applies when this is omitted.",
    )


class ToolCallError(ValueError):
    """A malformed call; the message tells the model what to fix."""


def parse_arguments(raw: Any, *, bound_session: bool = False) -> ToolArguments:
    """Read a model's raw arguments (a JSON string or an object), or explain what is wrong.
    `bound_session`: the caller keeps the session, so the model is not told of session_id."""
    raw = _json_object(raw, _CODE_EXAMPLE)
    try:
        return ToolArguments.model_validate(raw)
    except ValidationError as exc:
        raise ToolCallError(
            explain_invalid(exc)
            + ("" if bound_session else ' Add "session_id" to continue a session.')
        ) from None


def parse_shell_arguments(raw: Any) -> ShellToolArguments:
    """`run_command`'s raw arguments read, or what is wrong with them explained."""
    raw = _json_object(raw, _SHELL_EXAMPLE)
    try:
        return ShellToolArguments.model_validate(raw)
    except ValidationError as exc:
        raise ToolCallError(
            explain_invalid(exc, example=_SHELL_EXAMPLE)
            + ' Add "session_id" to continue a session.'
        ) from None


def _json_object(raw: Any, example: str) -> dict[str, Any]:
    """A model's arguments as an object: JSON text is read; anything else is explained."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolCallError(
                f"The arguments are not valid JSON ({exc.msg} at line {exc.lineno}, column "
                f"{exc.colno}). Send a JSON object such as {example}; put the code in a "
                "string and escape its quotes and newlines."
            ) from None
        except (ValueError, RecursionError):  # nested too deep, or an integer too long to read
            raise ToolCallError(
                "The arguments could not be read as JSON: they nest too deeply or hold a number "
                f"too long. Send a JSON object such as {example}."
            ) from None
    if not isinstance(raw, dict):
        raise ToolCallError(
            f"The arguments must be a JSON object such as {example}, not {type(raw).__name__}."
        )
    return raw


def explain_invalid(exc: ValidationError, *, example: str = _CODE_EXAMPLE) -> str:
    """Arguments that failed their schema, told so that a model can fix its call."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "arguments"
        if err["type"] == "missing":
            problems.append(f"'{where}' is missing")
        elif err["type"] == "string_too_short":
            problems.append(f"'{where}' is empty")
        else:
            problems.append(f"'{where}' {err['msg'].lower()}")
    listed = "; ".join(problems)
    return f"The arguments are not usable: {listed}. Send a JSON object such as {example}."
