"""The result models: what one execution produced, as the kernel said it.

These models flow back unchanged through every layer (sandbox -> session -> HTTP -> tool), so
they are plain pydantic v2 models that serialize to JSON without loss.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The MIME types we lift into named fields; anything else lands in `Result.extra`.
MIME_FIELDS: dict[str, str] = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "text/latex": "latex",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/svg+xml": "svg",
    "application/pdf": "pdf",
    "application/json": "json",
    "application/javascript": "javascript",
    # E2B's structured forms (its kernel's `e2b/*` formatters): a figure's chart, a DataFrame's
    # columns. Each is a JSON object; any other value stays in `extra`, as it came.
    "e2b/chart": "chart",
    "e2b/data": "data",
}
# The forms derived from another one the same result carries (a chart from its figure's image,
# columns from their table): the first to go when a result is too big to keep whole.
DERIVED_MIME_TYPES = ("e2b/chart", "e2b/data")


class ExecutionStatus(StrEnum):
    """How an execution ended. Only `ok` means the code ran to completion without raising."""

    OK = "ok"
    ERROR = "error"  # the code raised; the kernel and its state are intact
    TIMEOUT = "timeout"  # ran past its time limit and was interrupted (see `state_lost`)
    KERNEL_DIED = "kernel_died"  # the kernel process died; a fresh one replaced it, state lost
    CANCELLED = "cancelled"  # interrupted on request (explicit interrupt or a caller that left)


class Result(BaseModel):
    """One rich output: an `execute_result` (the cell's value) or a `display_data`.

    Each field holds one MIME form, as Jupyter sends it: text forms as str, binary images
    (png, jpeg, pdf) as base64 str, json as a parsed value; `chart` (a figure's data, in
    e2b-charts' shape) and `data` (a DataFrame's columns) as JSON objects.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    is_main_result: bool = False
    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    latex: str | None = None
    png: str | None = None
    jpeg: str | None = None
    svg: str | None = None
    pdf: str | None = None
    json_data: Any | None = Field(default=None, alias="json")
    javascript: str | None = None
    chart: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_bundle(cls, data: dict[str, Any], *, is_main_result: bool) -> Result:
        """Build a result from a Jupyter MIME bundle (`content["data"]`)."""
        fields: dict[str, Any] = {"is_main_result": is_main_result}
        extra: dict[str, Any] = {}
        for mime, value in data.items():
            name = MIME_FIELDS.get(mime)
            if mime in DERIVED_MIME_TYPES and not isinstance(value, dict):
                extra[mime] = value  # not the shape E2B's SDK reads: kept, not lifted
            elif mime in DERIVED_MIME_TYPES and not value:
                continue  # an empty chart: a blank figure (E2B's SDK reads it as none)
            elif name is None:
                extra[mime] = value
            else:
                fields[name] = value
        return cls(**fields, extra=extra)

    def images(self) -> list[tuple[str, bytes]]:
        """The image forms present, as (MIME type, raw bytes); undecodable ones are skipped."""
        out: list[tuple[str, bytes]] = []
        for mime, encoded in (("image/png", self.png), ("image/jpeg", self.jpeg)):
            if encoded is not None:
                try:
                    out.append((mime, base64.b64decode(encoded, validate=True)))
                except (binascii.Error, ValueError):
                    continue
        if self.svg is not None:
            out.append(("image/svg+xml", self.svg.encode()))
        return out


class ExecutionError(BaseModel):
    """Why an execution did not succeed: the exception the code raised, or what the runtime did."""

    name: str
    value: str
    traceback: str = ""


class Artifact(BaseModel):
    """An image an execution produced, addressable by a content-derived id."""

    id: str
    mime_type: str
    data: bytes
    result_index: int

    @property
    def extension(self) -> str:
        return {"image/png": "png", "image/jpeg": "jpg", "image/svg+xml": "svg"}[self.mime_type]


class Execution(BaseModel):
    """Everything one call to `execute` produced."""

    status: ExecutionStatus = ExecutionStatus.OK
    stdout: str = ""
    stderr: str = ""
    results: list[Result] = Field(default_factory=list)
    error: ExecutionError | None = None
    execution_count: int | None = None
    duration_s: float = 0.0
    started_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    # True when the kernel was replaced during this call: variables and imports are gone
    # (files in the workspace are kept).
    state_lost: bool = False
    # Something the runtime itself wants the reader to know (e.g. the kernel died while idle).
    notice: str | None = None
    # Characters dropped from stdout/stderr by the output cap (0 when nothing was dropped).
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    # Rich results left out by the per-execution limits (each leaves a note in its place).
    results_dropped: int = 0

    @property
    def ok(self) -> bool:
        return self.status is ExecutionStatus.OK

    @property
    def main_result(self) -> Result | None:
        return next((r for r in self.results if r.is_main_result), None)

    @property
    def text(self) -> str | None:
        """The text form of the cell's value, like a notebook's `Out[n]`."""
        main = self.main_result
        return main.text if main else None

    @cached_property
    def artifacts(self) -> list[Artifact]:
        """The images among the results, decoded, each with a stable content-derived id.

        Computed once: an execution's results do not change after it is built."""
        out: list[Artifact] = []
        for index, result in enumerate(self.results):
            for mime, data in result.images():
                digest = hashlib.sha256(data).hexdigest()[:24]
                out.append(Artifact(id=digest, mime_type=mime, data=data, result_index=index))
        return out


# Streaming events: what a caller sees while the code runs. The last event of a stream is
# always `done`, carrying the complete Execution.


class StdoutEvent(BaseModel):
    type: Literal["stdout"] = "stdout"
    text: str


class StderrEvent(BaseModel):
    type: Literal["stderr"] = "stderr"
    text: str


class ResultEvent(BaseModel):
    type: Literal["result"] = "result"
    result: Result


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    error: ExecutionError


class DoneEvent(BaseModel):
    type: Literal["done"] = "done"
    execution: Execution


OutputEvent = Annotated[
    StdoutEvent | StderrEvent | ResultEvent | ErrorEvent | DoneEvent,
    Field(discriminator="type"),
]
# Where a run's events go as they happen (a stream's queue); awaited, so it may apply backpressure.
EventSink = Callable[[OutputEvent], Awaitable[None]]


class FileInfo(BaseModel):
    """An entry of a sandbox's workspace."""

    path: str  # relative to the workspace root, '/'-separated
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    modified_at: datetime
    name_escaped: bool = Field(
        False,
        description="A name on the path is not valid UTF-8: its bytes are shown as \\xNN "
        "escapes, so the path names no file here; rename it from code to reach it.",
    )
