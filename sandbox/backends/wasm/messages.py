"""What a wasm sandbox's worker sends, as the service takes it (sandbox.py): each message
waited for by its run or call, its JSON measured before it is parsed (off the event loop when
large), and what a file call answers."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.results import FileInfo
from sandbox.backends.base import HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX
from sandbox.json_depth import nests_deeper_than
from sandbox.kernel.collector import RESULT_MAX_DEPTH, OutputCollector
from sandbox.kernel.wire import Malformed

OFF_LOOP_BYTES = 256 << 10  # a message larger than this is measured and parsed in a thread


class Pending:
    """What one run or call waits for: its outputs (a run's) and its end."""

    def __init__(self, collector: OutputCollector | None) -> None:
        self.collector = collector
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def take(self, kind: str, body: str) -> None:
        """One message of the sandbox's for this run or call. One that cannot be read (not
        JSON, nested too deep, the wrong shape) is dropped and counted on a run (an unreadable
        end ends it as an error: host.mjs passes on one end of each), and fails a call."""
        if self.done.done():
            return
        try:
            await self._take(kind, body)
        except (ValueError, Malformed) as exc:
            if self.collector is None:
                self.fail(SandboxError(f"the wasm sandbox sent an unreadable {kind}: {exc}"))
                return
            self.collector.malformed_messages += 1
            if kind in ("done", "failed"):
                self.done.set_result({"status": "error"})

    async def _take(self, kind: str, body: str) -> None:
        ends = ("done", "failed") if self.collector is not None else ("reply", "failed")
        if kind in ends:
            answer = await _parsed_off_loop(body)
            if kind == "failed":
                self.done.set_exception(SandboxError(f"the wasm worker: {answer.get('message')}"))
            else:
                self.done.set_result(answer)
        elif self.collector is not None and kind in (
            "stream",
            "error",
            "execute_result",
            "display_data",
        ):
            await self.collector.handle_content(await _parsed_off_loop(body), kind)

    def oversize(self, size: object, output: bool) -> None:
        """host.mjs would not carry a message this large: an output is left out (counted), an
        end or a call's answer fails it."""
        if output and self.collector is not None:
            self.collector.malformed_messages += 1
        else:
            self.fail(SandboxError(f"the wasm sandbox's answer of {size} bytes is too large"))

    def fail(self, error: SandboxError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # read: a run that gave up on it leaves no warning


def parsed_object(body: str) -> dict[str, Any]:
    """A message's JSON object, its depth measured before it is parsed (Python's parser
    raises RecursionError, not ValueError, on one nested some thousands deep)."""
    raw = body.encode()
    if nests_deeper_than(raw, RESULT_MAX_DEPTH):
        raise Malformed(f"a message nested deeper than {RESULT_MAX_DEPTH} levels")
    parsed = json.loads(raw)
    if not isinstance(parsed, dict):
        raise Malformed("a message that is not an object")
    return parsed


def relative_to_workspace(path: str) -> str:
    """A working directory as the sandbox's code names it (under /workspace or /home/user, or
    relative to the workspace), relative to the workspace."""
    for root in (WORKSPACE_IN_SANDBOX, HOME_IN_SANDBOX):
        if path == root or path.startswith(root + "/"):
            return path[len(root) :].lstrip("/")
    return path


def file_info(entry: Any) -> FileInfo:
    if not isinstance(entry, dict):
        raise SandboxError("the wasm sandbox described a file with something else")
    try:
        return FileInfo(
            path=str(entry.get("path", "")),
            type=entry.get("type", "other"),
            size=int(entry.get("size", 0)),
            modified_at=datetime.fromtimestamp(float(entry.get("modified_at", 0)), UTC),
        )
    except (ValueError, TypeError, OverflowError, OSError) as exc:
        raise SandboxError(f"the wasm sandbox described a file oddly: {exc}") from None


async def _parsed_off_loop(body: str) -> dict[str, Any]:
    if len(body) <= OFF_LOOP_BYTES:
        return parsed_object(body)
    return await asyncio.to_thread(parsed_object, body)
