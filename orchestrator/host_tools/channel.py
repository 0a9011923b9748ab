"""Serves one session's host-tool calls on the Unix socket in its sandbox's channel directory.

Protocol (sandbox/frames.py), both ways: a 4-byte big-endian length, then that many bytes of
JSON.
    sandbox -> host   {"id": 7, "tool": "get_expenses", "arguments": {"member_id": "m1"}}
    host -> sandbox   {"id": 7, "result": ...}
                  or  {"id": 7, "error": {"type": "timeout", "message": "..."}}
Many calls may be in flight on one connection; answers come back as they finish. A sandbox on
another machine (cluster mode) sends its call frames through its node's relay instead of this
socket; `ToolChannel.answer` answers one such frame the same way.

What the host checks, in order: the peer runs as the sandbox's uid; the frame is within the size
cap and is exactly a call; through the session's `CallGuard`, the execution (or command,
process) the frame names as its origin still runs; the tool is one this session may call (and,
through that guard, one its key's policy allows); the arguments are valid for its JSON schema;
a tool that needs a human's approval waits for it (a denial is a `denied` error frame). Then the
tool runs with a time limit, and its result must be JSON and within the size cap. Every failure
of a call is a typed error frame; anything that is not a well-formed call frame is refused and
the connection closed. Nothing but tool calls goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import to_jsonable_python

from code_interpreter_wire.approval_outcome import ApprovalOutcome
from orchestrator.host_tools.base import HostTool, HostToolError, ToolInputError
from sandbox.frames import (
    FRAME_TIMEOUT_S,
    MAX_CONNECTIONS,
    CallFrame,
    CallId,
    FrameRefused,
    error_frame,
    parse_call_frame,
    read_frame,
    refusal_frame,
    write_frame,
)
from sandbox.host_channel import MANIFEST_NAME, HostChannel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChannelLimits:
    call_timeout_s: float = 60.0
    max_call_bytes: int = 1 << 20
    max_result_bytes: int = 8 << 20
    max_calls_in_flight: int = 64
    frame_timeout_s: float = FRAME_TIMEOUT_S
    approval_timeout_s: float = 120.0  # added to the time limit of a tool that waits for one


@dataclass
class ToolCall:
    """One call as the guard is told of it when it ends: how it ended (`ok`, or the error
    frame's type, or `cancelled`) and what a human decided, if one was asked."""

    tool: str
    arguments: dict[str, Any]
    origin: str | None = None  # what started the caller, as the frame names it
    outcome: str = "ok"
    duration_s: float = 0.0
    approval: ApprovalOutcome | None = None
    started: float = field(default_factory=time.monotonic)


class CallGuard(ABC):
    """What the service checks around each call of one session's tools: its key's policy (read
    at each call, so a changed policy holds at once), a human's approval, and a record of every
    call. Without a guard, a channel serves every tool it was given."""

    @abstractmethod
    def may_call(self, name: str) -> bool:
        """Whether the session's key may call this tool now (a refusal reads exactly like a tool
        the session was not given)."""

    @abstractmethod
    async def refusal(self, origin: str | None) -> str | None:
        """Why no call from `origin` may run now (nothing it names runs in the session any
        more), or None when it may."""

    @abstractmethod
    def requires_approval(self, tool: HostTool) -> bool: ...

    @abstractmethod
    async def approve(
        self, tool: HostTool, arguments: dict[str, Any], origin: str | None
    ) -> ApprovalOutcome:
        """Wait for a human's decision on this call (bounded by the service's approval time),
        showing the code of the execution (or process) `origin` names."""

    @abstractmethod
    def finished(self, call: ToolCall) -> None:
        """Told once of every call, however it ended; never blocks."""


class ToolChannel:
    """The listener of one session's channel, with the tools that session may call."""

    def __init__(
        self,
        channel: HostChannel | None,
        tools: dict[str, HostTool],
        limits: ChannelLimits,
        guard: CallGuard | None = None,
    ):
        self.channel = channel  # None: it listens on no socket, calls come through `answer`
        self.tools = tools
        self.limits = limits
        self.guard = guard
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(limits.max_calls_in_flight)
        self._connections: set[asyncio.Task[Any]] = set()
        self.calls = 0  # answered calls, for tests and metrics

    @classmethod
    async def open(
        cls,
        channel: HostChannel,
        tools: dict[str, HostTool],
        limits: ChannelLimits,
        guard: CallGuard | None = None,
    ) -> ToolChannel:
        """Write the manifest the kernel reads, then listen."""
        self = cls(channel, tools, limits, guard)
        await asyncio.to_thread(channel.write_file, MANIFEST_NAME, self.manifest())
        sock = await asyncio.to_thread(channel.listen)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        return self

    @classmethod
    def relayed(
        cls, tools: dict[str, HostTool], limits: ChannelLimits, guard: CallGuard | None = None
    ) -> ToolChannel:
        """One that listens on no socket: the sandbox is on another machine (cluster mode),
        whose relay listens there; its calls come through `answer`, and `manifest()` is what
        that machine writes into the sandbox's channel directory."""
        return cls(None, tools, limits, guard)

    def _requires_approval(self, tool: HostTool) -> bool:
        return tool.requires_approval or (
            self.guard is not None and self.guard.requires_approval(tool)
        )

    def manifest(self) -> bytes:
        """What the sandbox learns of each tool: never a URL, a header or a command. The time
        limit of a tool that waits for a human includes that wait."""
        limits = self.limits
        tools = []
        for t in self.tools.values():
            timeout = t.timeout_s or limits.call_timeout_s
            waits = self._requires_approval(t)
            if waits:
                timeout += limits.approval_timeout_s
            tools.append(
                {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "returns": t.returns,
                    "timeout_s": timeout,
                    "requires_approval": waits,
                }
            )
        body = {
            "version": 1,
            "timeout_s": limits.call_timeout_s,
            "max_call_bytes": limits.max_call_bytes,
            "max_result_bytes": limits.max_result_bytes,
            "tools": tools,
        }
        return json.dumps(body, indent=1).encode()

    def close(self) -> None:
        """Stop listening and drop every connection and call in flight."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()

    # ----------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        sock = writer.get_extra_info("socket")
        assert self.channel is not None, "only a channel opened on a socket serves one"
        try:
            if not self.channel.peer_allowed(sock):
                log.warning("host tools: refused a connection from another uid")
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                await write_frame(writer, asyncio.Lock(), refusal_frame("too many connections"))
                return
            self._connections.add(task)
            await self._read_calls(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_calls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        calls: set[asyncio.Task[None]] = set()
        try:
            while True:
                body = await read_frame(
                    reader,
                    max_bytes=self.limits.max_call_bytes,
                    timeout_s=self.limits.frame_timeout_s,
                )
                if body is None:
                    return  # the peer closed between frames: a normal end
                call = parse_call_frame(body)
                await self._slots.acquire()
                task = asyncio.ensure_future(self._answer(call, writer, lock))
                calls.add(task)
                task.add_done_callback(calls.discard)
                # Released when the task ends in any way: one cancelled before it ran included.
                task.add_done_callback(lambda _: self._slots.release())
        except FrameRefused as exc:
            log.warning("host tools: refused and closed a connection: %s", exc)
            with contextlib.suppress(ConnectionError):
                await write_frame(writer, lock, refusal_frame(str(exc)))
        finally:
            for task in calls:
                task.cancel()

    async def answer(self, body: bytes) -> bytes:
        """The answer frame's body to one call frame's body (no length header either way),
        with the same checks, limits and count of calls in flight as one read from the
        socket. For call frames that came another way: in cluster mode, through the relay of
        the session's actor (`next_tool_calls` / `answer_tool_call`). A body that is not
        exactly a call is answered with a `refused` error frame (id null)."""
        try:
            call = parse_call_frame(body)
        except FrameRefused as exc:
            return error_frame(None, "refused", f"not a host tool call: {exc}")
        async with self._slots:
            reply = await self._run(call)
        self.calls += 1
        return reply

    async def _answer(
        self, frame: CallFrame, writer: asyncio.StreamWriter, lock: asyncio.Lock
    ) -> None:
        reply = await self._run(frame)
        self.calls += 1
        with contextlib.suppress(ConnectionError):
            await write_frame(writer, lock, reply)

    def _may_call(self, name: str) -> bool:
        return name in self.tools and (self.guard is None or self.guard.may_call(name))

    async def _run(self, frame: CallFrame) -> bytes:
        """One call, told to the guard (if any) when it ends, however it ends."""
        call = ToolCall(frame.tool, frame.arguments, frame.origin)
        try:
            return await self._call(frame.id, call)
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        finally:
            call.duration_s = time.monotonic() - call.started
            if self.guard is not None:
                self.guard.finished(call)

    async def _call(self, call_id: CallId, call: ToolCall) -> bytes:
        name, arguments = call.tool, call.arguments

        def failed(kind: str, message: str) -> bytes:
            call.outcome = kind
            return error_frame(call_id, kind, message)

        if self.guard is not None and (refused := await self.guard.refusal(call.origin)):
            return failed("denied", f"{name}: {refused}")
        tool = self.tools.get(name)
        if tool is None or not self._may_call(name):
            allowed = ", ".join(n for n in self.tools if self._may_call(n)) or "none"
            return failed(
                "not_allowed",
                f"{name!r} is not a host tool this session may call (it may call: {allowed})",
            )
        problems = tool.argument_errors(arguments)
        if problems:
            return failed("invalid_arguments", f"{name}: {'; '.join(problems[:10])}")
        if self._requires_approval(tool):
            if self.guard is None:  # never run unapproved: there is no one to ask here
                return failed("denied", f"{name} needs a human's approval; no one can give it here")
            call.approval = await self.guard.approve(tool, arguments, call.origin)
            if not call.approval.approved:
                return failed("denied", f"{name} was {call.approval.explain()}")
        limit = tool.timeout_s or self.limits.call_timeout_s
        try:
            async with asyncio.timeout(limit) as scope:
                result = await tool.call(arguments)
        except TimeoutError:
            if scope.expired():
                return failed("timeout", f"{name} did not finish within {limit:g} s")
            return failed("tool_error", f"{name} raised TimeoutError")
        except ToolInputError as exc:
            return failed("invalid_arguments", f"{name}: {exc}")
        except HostToolError as exc:
            return failed("tool_error", f"{name}: {exc}")
        except Exception as exc:
            log.info("host tool %s raised", name, exc_info=True)
            return failed("tool_error", f"{type(exc).__name__}: {exc}")
        try:
            body = json.dumps({"id": call_id, "result": to_jsonable_python(result)}).encode()
        except (TypeError, ValueError) as exc:
            return failed("tool_error", f"{name} returned a value that is not JSON: {exc}")
        if len(body) > self.limits.max_result_bytes:
            return failed(
                "too_large",
                f"{name} returned {len(body)} bytes, over the limit of "
                f"{self.limits.max_result_bytes}: ask for less (filter, page, summarise)",
            )
        return body
