"""The `code_interpreter` tool: its definition in each agent API's format, the parsing of a
model's raw arguments, and the rendering of an execution as that API's tool output.

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

from sandbox.models import Execution, ExecutionStatus

TOOL_NAME = "code_interpreter"
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

    code: str = Field(min_length=1, description="Python code to run in the session's kernel.")
    session_id: str | None = Field(
        None,
        description="The session to run in, from an earlier result. Omit it to start a new "
        "session; pass it again to keep variables, imports and files.",
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
) -> str:
    """What the model reads. `bound_session`: the caller keeps one session per conversation
    (an agent framework's tool, an MCP connection), so the model need not pass session_id.
    `host_tools`: (call signature, summary) of each host tool the code may call.
    `session_note`: more on sessions, said right after how state persists."""
    return (
        "Run Python 3.11 code in a stateful, sandboxed Jupyter kernel and get back what it "
        "printed, the value of its last expression (as in a notebook), errors with tracebacks, "
        "and images (matplotlib figures shown with plt.show() or left as the last expression). "
        + (_STATE_BOUND if bound_session else _STATE_BY_ARGUMENT)
        + (f"{session_note} " if session_note else "")
        + f"Installed: {', '.join(libraries)}. "
        "The working directory is /workspace: files the user uploaded are there, and files you "
        "save there (e.g. df.to_csv('out.csv')) can be downloaded by the user. "
        "There is no network access: pip install and web requests fail. "
        f"Each call may run for up to {timeout_s:g} seconds; input() is not available."
        + host_tools_text(host_tools)
    )


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


# The arguments when the caller keeps the session (bound_session): the code alone. Strict-mode
# valid (every property required, no others), as OpenAI's strict function calling wants.
CODE_ONLY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "Python code to run."}},
    "required": ["code"],
    "additionalProperties": False,
}


def definitions(
    *, timeout_s: float, libraries: list[str], host_tools: Sequence[tuple[str, str]] = ()
) -> dict[str, Any]:
    """The tool's definition in every supported format."""
    text = description(timeout_s=timeout_s, libraries=libraries, host_tools=host_tools)
    schema = {
        "type": "object",
        "properties": {
            "code": {
                "type": "string",
                "description": ToolArguments.model_fields["code"].description,
            },
            "session_id": {
                "type": "string",
                "description": ToolArguments.model_fields["session_id"].description,
            },
        },
        "required": ["code"],
        "additionalProperties": False,
    }
    return {
        "json_schema": schema,
        ToolFormat.OPENAI_CHAT: {
            "type": "function",
            "function": {"name": TOOL_NAME, "description": text, "parameters": schema},
        },
        ToolFormat.OPENAI_RESPONSES: {
            "type": "function",
            "name": TOOL_NAME,
            "description": text,
            "parameters": schema,
            "strict": False,
        },
        ToolFormat.ANTHROPIC: {"name": TOOL_NAME, "description": text, "input_schema": schema},
        ToolFormat.MCP: {"name": TOOL_NAME, "description": text, "inputSchema": schema},
    }


def parse_arguments(raw: Any, *, bound_session: bool = False) -> ToolArguments:
    """Read a model's raw arguments (a JSON string or an object), or explain what is wrong.
    `bound_session`: the caller keeps the session, so the model is not told of session_id."""
    example = '{"code": "print(1 + 1)"}'
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
    try:
        return ToolArguments.model_validate(raw)
    except ValidationError as exc:
        raise ToolCallError(
            explain_invalid(exc)
            + ("" if bound_session else ' Add "session_id" to continue a session.')
        ) from None


def explain_invalid(exc: ValidationError) -> str:
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
    return (
        f"The arguments are not usable: {'; '.join(problems)}. "
        'Send a JSON object such as {"code": "print(1 + 1)"}.'
    )


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


def render(
    execution: Execution,
    *,
    session_id: str,
    max_chars: int,
    full_output_url: str | None,
    artifact_urls: dict[str, str],
) -> RenderedOutput:
    """The execution as a model should read it."""
    budget = max_chars
    parts: list[str] = []
    trimmed = 0
    sections = [("stdout", execution.stdout), ("stderr", execution.stderr)]
    for r in execution.results:
        if r.text is not None and not r.images():
            sections.append(("result" if r.is_main_result else "display", r.text))
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
        parts.append(f"[error] {error.name}: {error.value}" + (f"\n{tb}" if tb else ""))
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
    parts.append(
        f"[status] {execution.status}{count} · {execution.duration_s:.2f} s · "
        f"session_id {session_id}{state}"
    )
    if execution.status is ExecutionStatus.OK and len(parts) == 1:
        parts.insert(0, "(no output)")
    text = "\n".join(parts)
    text, _ = _trim(text, max_chars + 500)
    return RenderedOutput(text, images, is_error=execution.status is not ExecutionStatus.OK)


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
