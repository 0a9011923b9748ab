"""The `code_interpreter` tool, and the optional `run_command` shell tool beside it: their
definitions in each agent API's format, the parsing of a model's raw arguments, and the
rendering of an execution or a command as that API's tool output.

A model reads the output, so the text says plainly what happened, trims what is too long (and
says so), and tells how to fix a malformed call instead of failing it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.governance.approval_outcome import ApprovalOutcome
from sandbox.languages import PYTHON
from sandbox.models import Execution, ExecutionStatus, Result
from sandbox.network_policy import NO_NETWORK, NetworkPolicy
from sandbox.processes.models import CommandResult

TOOL_NAME = "code_interpreter"
SHELL_TOOL_NAME = "run_command"
_CODE_EXAMPLE = '{"code": "print(1 + 1)"}'
_SHELL_EXAMPLE = '{"command": "ls -la"}'
# What the kernel has installed (the `kernel` extra), named in the description.
LIBRARIES = [
    "numpy", "pandas", "matplotlib", "scipy", "scikit-learn", "seaborn", "pillow", "openpyxl",
]  # fmt: skip
_TRACEBACK_LINES = 30
# Image types each API accepts inline; others are referred to by link in the text.
_MODEL_IMAGE_TYPES = {"image/png", "image/jpeg", "image/gif", "image/webp"}
# What model APIs take in one message (Anthropic: 5 MB an image; all: a bounded count).
MAX_INLINE_IMAGES = 20
MAX_INLINE_IMAGE_BYTES = 5 * 1024 * 1024


def _attachable(image: Image) -> bool:
    return image.mime_type in _MODEL_IMAGE_TYPES and len(image.data) <= MAX_INLINE_IMAGE_BYTES


class ToolFormat(StrEnum):
    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC = "anthropic"
    MCP = "mcp"


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


@dataclass
class Image:
    mime_type: str
    data: bytes
    url: str | None  # where the stored copy is served; None when not stored


@dataclass
class RenderedOutput:
    text: str
    images: list[Image]
    is_error: bool

    def attached(self) -> list[Image]:
        """The images a model API takes inline: supported types and sizes, a bounded count."""
        return [i for i in self.images if _attachable(i)][:MAX_INLINE_IMAGES]


def _trim(text: str, limit: int) -> tuple[str, int]:
    if len(text) <= limit:
        return text, 0
    head = limit * 2 // 3
    tail = limit - head
    return text[:head] + "\n[...]\n" + text[len(text) - tail :], len(text) - limit


def _result_text(result: Result) -> str | None:
    """What a model reads of a rich result that is no image: its plain text (R's data frames
    carry one beside their HTML), else its Markdown, else a word on what it was (an HTML-only
    display, as Deno's `Deno.jupyter.html` makes)."""
    if result.text is not None:
        return result.text
    if result.markdown is not None:
        return result.markdown
    forms = [name for name in ("html", "latex", "json_data", "javascript") if getattr(result, name)]
    if not forms:
        return None
    shown = ", ".join(name.removesuffix("_data").upper() for name in forms)
    return f"({shown} output with no plain-text form; it is kept in the full execution)"


def _error_heading(name: str, value: str) -> str:
    """An error's first line. A kernel may give no name: Bash's says only the exit status."""
    if name:
        return f"{name}: {value}"
    if value.strip().isdigit():
        return f"exit status {value.strip()}"
    return value.strip() or "the code failed"


def render(
    execution: Execution,
    *,
    language: str | None = None,
    session_id: str,
    max_chars: int,
    full_output_url: str | None,
    artifact_urls: dict[str, str],
    approvals: Sequence[ApprovalOutcome] = (),
) -> RenderedOutput:
    """The execution as a model should read it; `language`: the kernel's, said when not
    Python's; `approvals`: what waited for a human (the execution, its tool calls)."""
    budget = max_chars
    parts: list[str] = []
    trimmed = 0
    sections = [("stdout", execution.stdout), ("stderr", execution.stderr)]
    for r in execution.results:
        shown = None if r.images() else _result_text(r)
        if shown is not None:
            sections.append(("result" if r.is_main_result else "display", shown))
    share = max(200, budget // max(1, len(sections) + 1))
    for name, body in sections:
        if not body:
            continue
        body, cut = _trim(body.rstrip("\n"), share)
        trimmed += cut
        parts.append(f"[{name}]\n{body}")
    dropped = execution.stdout_dropped + execution.stderr_dropped
    if trimmed or dropped:
        where = f" The full output: GET {full_output_url}" if full_output_url else ""
        parts.append(f"[note] {trimmed + dropped} characters of output were left out here.{where}")
    error = execution.error
    if error is not None:
        lines = error.traceback.strip("\n").splitlines()
        if len(lines) > _TRACEBACK_LINES:
            lines = ["(traceback trimmed to its last lines)", *lines[-_TRACEBACK_LINES:]]
        tb = "\n".join(lines)
        parts.append(
            f"[error] {_error_heading(error.name, error.value)}" + (f"\n{tb}" if tb else "")
        )
    images: list[Image] = []
    for artifact in execution.artifacts:
        url = artifact_urls.get(artifact.id)
        images.append(Image(artifact.mime_type, artifact.data, url))
    if images:
        listed = ", ".join(f"{i.mime_type}" + (f" at {i.url}" if i.url else "") for i in images)
        parts.append(f"[images] {len(images)}: {listed}")
        attached = min(MAX_INLINE_IMAGES, sum(1 for i in images if _attachable(i)))
        if attached < len(images):
            parts.append(
                f"[note] {attached} of them are attached: at most {MAX_INLINE_IMAGES} PNG, JPEG, "
                f"GIF or WebP images of up to {MAX_INLINE_IMAGE_BYTES >> 20} MB each"
            )
    if execution.notice:
        parts.append(f"[notice] {execution.notice}")
    state = " · kernel restarted, earlier variables are gone" if execution.state_lost else ""
    count = f" · In[{execution.execution_count}]" if execution.execution_count else ""
    if language is not None and language != PYTHON:
        count = f" · {language}{count}"
    parts.append(
        f"[status] {execution.status}{count} · {execution.duration_s:.2f} s · "
        f"session_id {session_id}{state}"
    )
    if execution.status is ExecutionStatus.OK and len(parts) == 1:
        parts.insert(0, "(no output)")
    parts[-1:-1] = approval_lines(approvals)  # just before the status
    text = "\n".join(parts)
    text, _ = _trim(text, max_chars + 500)
    return RenderedOutput(text, images, is_error=execution.status is not ExecutionStatus.OK)


def approval_lines(approvals: Sequence[ApprovalOutcome]) -> list[str]:
    """`[approval] send_money waited 2.1 s: approved by alice`, one line each (at most 20, then
    how many more)."""
    lines = [f"[approval] {a.line()}" for a in approvals[:20]]
    if len(approvals) > 20:
        lines.append(f"[approval] ... and {len(approvals) - 20} more calls waited for approval")
    return lines


def render_command(
    result: CommandResult,
    *,
    session_id: str,
    max_chars: int,
    approvals: Sequence[ApprovalOutcome] = (),
) -> RenderedOutput:
    """A `run_command` result as a model should read it: its output trimmed as the code tool's
    is, what was left out counted, and how it ended; `approvals`: what waited for a human."""
    parts: list[str] = []
    trimmed = 0
    share = max(200, max_chars // 3)
    for name, body in (("stdout", result.stdout), ("stderr", result.stderr)):
        if not body:
            continue
        body, cut = _trim(body.rstrip("\n"), share)
        trimmed += cut
        parts.append(f"[{name}]\n{body}")
    left_out = trimmed + result.stdout_dropped + result.stderr_dropped
    if left_out:  # commands are not kept: the way to all of it is a file
        parts.append(
            f"[note] {left_out} characters of output were left out here. To read all of it, "
            "write it to a file (COMMAND > out.txt 2>&1) and read parts with head, tail or grep."
        )
    if result.error and (result.exit_code is None or result.timed_out):
        parts.append(f"[error] {result.error}")
    if result.timed_out:
        ended = "timed out, killed with everything it started"
    elif result.exit_code is not None:
        ended = f"exit code {result.exit_code}"
    elif result.signal is not None:
        ended = f"killed by signal {result.signal}"
    else:
        ended = "ended without an exit code"
    parts.append(f"[status] {ended} · {result.duration_s:.2f} s · session_id {session_id}")
    failed = result.timed_out or result.exit_code != 0
    if not failed and len(parts) == 1:
        parts.insert(0, "(no output)")
    parts[-1:-1] = approval_lines(approvals)  # just before the status
    text, _ = _trim("\n".join(parts), max_chars + 500)
    return RenderedOutput(text, [], is_error=failed)


def format_output(
    fmt: ToolFormat, output: RenderedOutput, *, call_id: str | None, inline_images: bool
) -> dict[str, Any]:
    """The tool output in the shape the caller's API expects.

    Returns {"output": ..., "extra_messages": [...]}: OpenAI chat completions takes no images in
    a tool message, so images go in a user message to append after it.
    """

    def image_url(image: Image) -> str | None:
        if inline_images or image.url is None:
            return f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode()}"
        return image.url

    shown = output.attached()
    extra: list[dict[str, Any]] = []
    result: dict[str, Any]
    if fmt is ToolFormat.OPENAI_CHAT:
        result = {"role": "tool", "tool_call_id": call_id or "", "content": output.text}
        if shown:
            extra.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": f"Images from {TOOL_NAME} call {call_id or ''}:"},
                        *({"type": "image_url", "image_url": {"url": image_url(i)}} for i in shown),
                    ],
                }
            )
    elif fmt is ToolFormat.OPENAI_RESPONSES:
        content: Any = output.text
        if shown:
            content = [
                {"type": "input_text", "text": output.text},
                *({"type": "input_image", "image_url": image_url(i)} for i in shown),
            ]
        result = {"type": "function_call_output", "call_id": call_id or "", "output": content}
    elif fmt is ToolFormat.ANTHROPIC:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": output.text}]
        for i in shown:
            url = image_url(i)
            assert url is not None
            source = (
                {"type": "url", "url": url}
                if not url.startswith("data:")
                else {
                    "type": "base64",
                    "media_type": i.mime_type,
                    "data": base64.b64encode(i.data).decode(),
                }
            )
            blocks.append({"type": "image", "source": source})
        result = {
            "type": "tool_result",
            "tool_use_id": call_id or "",
            "content": blocks,
            "is_error": output.is_error,
        }
    else:  # MCP: images travel inline, as the protocol has them
        result = {
            "content": [
                {"type": "text", "text": output.text},
                *(
                    {
                        "type": "image",
                        "data": base64.b64encode(i.data).decode(),
                        "mimeType": i.mime_type,
                    }
                    for i in shown
                ),
            ],
            "isError": output.is_error,
        }
    return {"output": result, "extra_messages": extra}
