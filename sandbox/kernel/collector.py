"""Turns a kernel's iopub messages for one request into an Execution, and into stream events."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from pydantic import ValidationError

from code_interpreter_wire.results import (
    DERIVED_MIME_TYPES,
    ErrorEvent,
    Execution,
    ExecutionError,
    OutputEvent,
    Result,
    ResultEvent,
    StderrEvent,
    StdoutEvent,
)
from code_interpreter_wire.results import (
    EventSink as EventSink,  # where it was first; it lives beside the models
)
from sandbox.json_depth import nests_deeper_than
from sandbox.kernel.long_text import CutText
from sandbox.kernel.wire import INLINE_DECODE_BYTES, Frame, KernelMessage, Malformed

# A rich output's content (its MIME bundle within the message) nests at most this deep.
RESULT_MAX_DEPTH = 100

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    if isinstance(text, CutText):  # its head and tail, each on its own
        return CutText(_ANSI.sub("", text.head), _ANSI.sub("", text.tail), text.dropped)
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
        if isinstance(text, CutText):  # cut before decoding: its middle counts as dropped
            self.append(text.head)
            self.skip(text.dropped)
            self.append(text.tail)
            return
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

    def skip(self, count: int) -> None:
        """`count` characters came that nobody has: what the tail held before them is no longer
        the end either (a `CutText` brings a whole tail after them)."""
        if count:
            self.dropped += len(self.tail) + count
            self.tail = ""

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


# A MIME bundle has a handful of forms; a bundle with more keys than this is left out whole.
MAX_BUNDLE_KEYS = 64
# An error's name is a class name: more than this is cut like any other text.
ERROR_NAME_LIMIT = 1000


def bundle_size(data: dict[str, Any]) -> int:
    """Characters a bundle holds: keys count as much as values."""
    return sum(
        len(k) + (len(v) if isinstance(v, str) else len(json.dumps(v))) for k, v in data.items()
    )


def capped(text: str, limit: int, name: str) -> str:
    """`text` within `limit` characters: its head and tail, with a marker where it was cut."""
    if len(text) <= limit and not isinstance(text, CutText):
        return text
    kept = CappedText(name, limit)
    kept.append(text)
    return kept.value()[0]


def _bundle_label(data: dict[str, Any]) -> str:
    """A few of a bundle's keys, each short: for a note that must stay small."""
    keys = [k if len(k) <= 80 else k[:80] + "..." for k in list(data)[:5]]
    more = f" and {len(data) - 5} more" if len(data) > 5 else ""
    return ", ".join(keys) + more


# How far over what a run may still keep an output may be and still be decoded to drop its
# derived forms: the two forms the kernel sends are at most 4 MiB of JSON each (display_forms.py).
DERIVED_FORMS_SLACK = 10 << 20
_DERIVED_FORM_KEY = re.compile(rb'"e2b/')  # searches ZeroMQ's buffer in place


def _may_carry_derived_forms(msg: KernelMessage) -> bool:
    """Whether a rich output too big to keep may shrink to fit by dropping its derived forms
    (`DERIVED_MIME_TYPES`): then it is decoded, within the frame limit, to find out."""
    return _DERIVED_FORM_KEY.search(msg.content_bytes) is not None


async def _nests_too_deep(content: Frame) -> bool:
    """Whether a rich output's JSON nests past `RESULT_MAX_DEPTH` (measured off the loop when
    large): pydantic refuses to serialise past ~250 levels and recursive encoders fail sooner."""
    if len(content) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(_nests_deeper, content)
    return _nests_deeper(content)


def _nests_deeper(content: Frame) -> bool:
    return nests_deeper_than(bytes(content), RESULT_MAX_DEPTH)  # it reads bytes, not views


# Kinds of iopub message whose strings are text kept within the output limit.
_TEXT_KINDS = ("stream", "error", "execute_input")


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
        self.output_limit = output_limit
        self.stdout = CappedText("stdout", output_limit)
        self.stderr = CappedText("stderr", output_limit)
        self.results: list[Result] = []
        self.result_bytes_left = result_limit_bytes
        self.result_limit_count = result_limit_count
        self.results_too_big = 0  # each replaced by a note in place
        self.results_over_count = 0  # counted in one note at the end
        self.error: ExecutionError | None = None
        self.execution_count: int | None = None
        self.malformed_messages = 0  # kernel messages dropped as unusable during the run
        self.end_unconfirmed = False  # the kernel's idle status for the run never came
        self.sink = sink

    async def take(self, msg: KernelMessage) -> None:
        """Take one iopub message that belongs to our request; raise `Malformed` if unusable.

        A rich output larger on the wire than what the run may still keep is left out without
        being decoded at all; so is any kind of message no run uses. Texts are cut to what the
        output limit keeps before they are decoded.
        """
        if msg.msg_type in _TEXT_KINDS:
            await self.handle_content(await msg.text_content(self.output_limit), msg.msg_type)
            return
        if msg.msg_type in ("execute_result", "display_data"):
            is_main = msg.msg_type == "execute_result"
            if len(self.results) >= self.result_limit_count:
                self.results_over_count += 1  # counted, never decoded
                return
            over = msg.content_size - self.result_bytes_left
            if over > 0 and not (over <= DERIVED_FORMS_SLACK and _may_carry_derived_forms(msg)):
                await self._add_result(self._left_out(msg.content_size, "", is_main))
                return
            if await _nests_too_deep(msg.content_bytes):
                self.results_too_big += 1
                await self._add_result(
                    Result(
                        is_main_result=is_main,
                        text=f"[a rich output nested deeper than {RESULT_MAX_DEPTH} levels was "
                        "left out: no encoder downstream can be trusted with it; flatten it]",
                    )
                )
                return
            await self.handle_content(await msg.content(), msg.msg_type)
        # Any other kind (clear_output, comm messages...) is nothing a run keeps: never decoded.

    async def handle(self, msg: dict[str, Any]) -> None:
        """Take one iopub-shaped message (`header.msg_type`, `content`) built by a backend."""
        await self.handle_content(msg["content"], msg["header"]["msg_type"])

    async def handle_content(self, content: dict[str, Any], kind: str) -> None:
        """Take one decoded iopub message's content; raise `Malformed` if it is unusable."""
        if kind == "stream":
            text, name = content.get("text"), content.get("name")
            if not isinstance(text, str):
                raise Malformed("a stream message without text")
            if name == "stderr":
                self.stderr.append(text)
                await self._emit(StderrEvent(text=capped(text, self.output_limit, "stderr")))
            else:
                self.stdout.append(text)
                await self._emit(StdoutEvent(text=capped(text, self.output_limit, "stdout")))
        elif kind in ("execute_result", "display_data"):
            data = content.get("data", {})
            if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
                raise Malformed(f"a {kind} message whose data is not a MIME bundle")
            result = self._admit(data, kind == "execute_result")
            if result is not None:
                await self._add_result(result)
        elif kind == "error":
            name, value, traceback = (content.get(k) for k in ("ename", "evalue", "traceback"))
            if not isinstance(traceback, list) or not all(isinstance(t, str) for t in traceback):
                raise Malformed("an error message whose traceback is not a list of strings")
            if not isinstance(name, str) or not isinstance(value, str):
                raise Malformed("an error message whose name or value is not a string")
            await self.emit_error(
                ExecutionError(
                    name=capped(name, ERROR_NAME_LIMIT, "the error name"),
                    value=capped(value, self.output_limit, "the error value"),
                    traceback=self._capped_traceback(traceback),
                )
            )
        elif kind == "execute_input":
            count = content.get("execution_count")
            if isinstance(count, int):
                self.execution_count = count

    def _capped_traceback(self, lines: list[str]) -> str:
        kept = CappedText("the traceback", self.output_limit)
        for i, line in enumerate(lines):
            if i:
                kept.append("\n")
            kept.append(strip_ansi(line))
        return kept.value()[0]

    async def _add_result(self, result: Result) -> None:
        self.results.append(result)
        await self._emit(ResultEvent(result=result))

    async def _emit(self, event: OutputEvent) -> None:
        if self.sink is not None:
            await self.sink(event)

    def _left_out(self, size: int, label: str, is_main: bool) -> Result:
        self.results_too_big += 1
        what = f" ({label})" if label else ""
        return Result(
            is_main_result=is_main,
            text=f"[a rich output of {size} bytes{what} was left out: it is over what one "
            "execution may return; save it to a file in the workspace and download that instead]",
        )

    def _admit(self, data: dict[str, Any], is_main: bool) -> Result | None:
        """The result as kept: whole, replaced by a note when too big, or None past the count."""
        if len(self.results) >= self.result_limit_count:
            self.results_over_count += 1
            return None
        if len(data) > MAX_BUNDLE_KEYS:
            self.results_too_big += 1
            return Result(
                is_main_result=is_main,
                text=f"[a rich output with {len(data)} MIME types was left out: one output may "
                f"have at most {MAX_BUNDLE_KEYS}]",
            )
        size = bundle_size(data)
        if size > self.result_bytes_left and any(m in data for m in DERIVED_MIME_TYPES):
            # A chart or a table's columns never cost the figure or the table itself.
            data = {m: v for m, v in data.items() if m not in DERIVED_MIME_TYPES}
            size = bundle_size(data)
        if size > self.result_bytes_left:
            return self._left_out(size, _bundle_label(data), is_main)
        self.result_bytes_left -= size
        try:
            return Result.from_bundle(data, is_main_result=is_main)
        except ValidationError:  # raw display() can send anything: keep it, as it came
            return Result(is_main_result=is_main, extra=dict(data))

    async def emit_error(self, error: ExecutionError) -> None:
        """Record an error (the code's, or one the runtime raised: timeout, dead kernel...)."""
        self.error = error
        await self._emit(ErrorEvent(error=error))

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
        notes = []
        if self.malformed_messages:
            notes.append(
                f"{self.malformed_messages} malformed messages from the kernel were dropped "
                "(bad framing, signature or JSON, a wrong shape, or too big to take)."
            )
        if self.end_unconfirmed:
            notes.append(
                "The kernel finished this run but its end-of-output signal never came (lost "
                "under a flood of output): output sent just before the end may be missing."
            )
        if notes:
            notice = fields.pop("notice", None)
            fields["notice"] = "\n".join([notice, *notes] if notice else notes)
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
