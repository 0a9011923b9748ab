"""An execution or a command rendered as a tool's output: the text a model reads (it says
plainly what happened, trims what is too long and says so), its images, and that output in the
shape each agent API expects.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.processes import CommandResult
from code_interpreter_wire.results import Execution, ExecutionStatus, Result
from code_interpreter_wire.tool_arguments import TOOL_NAME
from code_interpreter_wire.tool_definitions import ToolFormat

_TRACEBACK_LINES = 30
# Image types each API accepts inline; others are referred to by link in the text.
_MODEL_IMAGE_TYPES = {"image/png", "image/jpeg", "image/gif", "image/webp"}
# What model APIs take in one message (Anthropic: 5 MB an image; all: a bounded count).
MAX_INLINE_IMAGES = 20
MAX_INLINE_IMAGE_BYTES = 5 * 1024 * 1024


def _attachable(image: Image) -> bool:
    return image.mime_type in _MODEL_IMAGE_TYPES and len(image.data) <= MAX_INLINE_IMAGE_BYTES


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
