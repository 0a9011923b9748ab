"""Turns a kernel's iopub messages for one request into an Execution, and into stream events."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from sandbox.models import (
    ErrorEvent,
    Execution,
    ExecutionError,
    OutputEvent,
    Result,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)

EventSink = Callable[[OutputEvent], Awaitable[None]]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


class CappedText:
    """Keeps the head and the tail of a text stream within `limit` characters.

    What is cut from the middle is replaced by a marker that says how much was dropped, so a
    flood never hides the output's start (what the code was doing) or its end (how it finished).
    """

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head: list[str] = []
        self.head_len = 0
        self.tail = ""
        self.dropped = 0

    def append(self, text: str) -> None:
        room = self.head_limit - self.head_len
        if room > 0:
            self.head.append(text[:room])
            self.head_len += min(room, len(text))
            text = text[room:]
        if not text:
            return
        self.tail += text
        if len(self.tail) > 2 * self.tail_limit:  # trim in chunks: amortized O(n)
            cut = len(self.tail) - self.tail_limit
            self.dropped += cut
            self.tail = self.tail[cut:]

    def value(self) -> tuple[str, int]:
        """The kept text, with the marker where text was dropped; and how much was dropped."""
        tail, dropped = self.tail, self.dropped
        if len(tail) > self.tail_limit:
            dropped += len(tail) - self.tail_limit
            tail = tail[len(tail) - self.tail_limit :]
        head = "".join(self.head)
        if not dropped:
            return head + tail, 0
        marker = (
            f"\n[... {dropped} characters of {self.name} dropped: the output limit keeps the "
            f"first {self.head_limit} and the last {self.tail_limit} ...]\n"
        )
        return head + marker + tail, dropped


def bundle_size(data: dict[str, Any]) -> int:
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in data.values())


class OutputCollector:
    """Accumulates one execution's outputs; forwards each as an event as it arrives."""

    def __init__(
        self,
        output_limit: int,
        sink: EventSink | None,
        *,
        result_limit_bytes: int = 50 << 20,
        result_limit_count: int = 1000,
    ) -> None:
        self.stdout = CappedText("stdout", output_limit)
        self.stderr = CappedText("stderr", output_limit)
        self.results: list[Result] = []
        self.result_bytes_left = result_limit_bytes
        self.result_limit_count = result_limit_count
        self.results_too_big = 0  # each replaced by a note in place
        self.results_over_count = 0  # counted in one note at the end
        self.error: ExecutionError | None = None
        self.execution_count: int | None = None
        self.sink = sink

    async def handle(self, msg: dict[str, Any]) -> None:
        """Take one iopub message that belongs to our request."""
        kind = msg["header"]["msg_type"]
        content = msg["content"]
        event: OutputEvent | None = None
        if kind == "stream":
            text = content.get("text", "")
            if content.get("name") == "stderr":
                self.stderr.append(text)
                event = StderrEvent(text=text)
            else:
                self.stdout.append(text)
                event = StdoutEvent(text=text)
        elif kind in ("execute_result", "display_data"):
            result = self._admit(content.get("data", {}), kind == "execute_result")
            if result is not None:
                self.results.append(result)
                event = ResultEvent(result=result)
        elif kind == "error":
            self.error = ExecutionError(
                name=content.get("ename", "Error"),
                value=content.get("evalue", ""),
                traceback=strip_ansi("\n".join(content.get("traceback", []))),
            )
            event = ErrorEvent(error=self.error)
        elif kind == "execute_input":
            self.execution_count = content.get("execution_count")
        if event is not None and self.sink is not None:
            await self.sink(event)

    def _admit(self, data: dict[str, Any], is_main: bool) -> Result | None:
        """The result as kept: whole, replaced by a note when too big, or None past the count."""
        if len(self.results) >= self.result_limit_count:
            self.results_over_count += 1
            return None
        size = bundle_size(data)
        if size > self.result_bytes_left:
            self.results_too_big += 1
            return Result(
                is_main_result=is_main,
                text=f"[a rich output of {size} bytes ({', '.join(data)}) was left out: it is "
                "over what one execution may return; save it to a file in the workspace and "
                "download that instead]",
            )
        self.result_bytes_left -= size
        try:
            return Result.from_bundle(data, is_main_result=is_main)
        except ValidationError:  # raw display() can send anything: keep it, as it came
            return Result(is_main_result=is_main, extra=dict(data))

    async def emit_error(self, error: ExecutionError) -> None:
        """Record an error the runtime itself raised (timeout, dead kernel...)."""
        self.error = error
        if self.sink is not None:
            await self.sink(ErrorEvent(error=error))

    def build(self, **fields: Any) -> Execution:
        stdout, stdout_dropped = self.stdout.value()
        stderr, stderr_dropped = self.stderr.value()
        results = self.results
        if self.results_over_count:
            note = (
                f"[{self.results_over_count} more rich outputs were left out: one execution "
                f"returns at most {self.result_limit_count}]"
            )
            results = [*results, Result(text=note)]
        return Execution(
            stdout=stdout,
            stderr=stderr,
            stdout_dropped=stdout_dropped,
            stderr_dropped=stderr_dropped,
            results=results,
            results_dropped=self.results_too_big + self.results_over_count,
            error=self.error,
            execution_count=self.execution_count,
            **fields,
        )
