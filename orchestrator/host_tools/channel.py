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
cap and is exactly a call; the tool is one this session may call; the arguments are valid for
its JSON schema. Then the tool runs with a time limit, and its result must be JSON and within the
size cap. Every failure of a call is a typed error frame; anything that is not a well-formed
call frame is refused and the connection closed. Nothing but tool calls goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic_core import to_jsonable_python

from orchestrator.host_tools.base import HostTool, HostToolError, ToolInputError
from sandbox.frames import (
    FRAME_TIMEOUT_S,
    MAX_CONNECTIONS,
    CallId,
    FrameRefused,
    error_frame,
    parse_call,
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


class ToolChannel:
    """The listener of one session's channel, with the tools that session may call."""

    def __init__(
        self, channel: HostChannel | None, tools: dict[str, HostTool], limits: ChannelLimits
    ):
        self.channel = channel  # None: it listens on no socket, calls come through `answer`
        self.tools = tools
        self.limits = limits
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(limits.max_calls_in_flight)
        self._connections: set[asyncio.Task[Any]] = set()
        self.calls = 0  # answered calls, for tests and metrics

    @classmethod
    async def open(
        cls, channel: HostChannel, tools: dict[str, HostTool], limits: ChannelLimits
    ) -> ToolChannel:
        """Write the manifest the kernel reads, then listen."""
        self = cls(channel, tools, limits)
        await asyncio.to_thread(channel.write_file, MANIFEST_NAME, self.manifest())
        sock = await asyncio.to_thread(channel.listen)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        return self

    @classmethod
    def relayed(cls, tools: dict[str, HostTool], limits: ChannelLimits) -> ToolChannel:
        """One that listens on no socket: the sandbox is on another machine (cluster mode),
        whose relay listens there; its calls come through `answer`, and `manifest()` is what
        that machine writes into the sandbox's channel directory."""
        return cls(None, tools, limits)

    def manifest(self) -> bytes:
        """What the sandbox learns of each tool: never a URL, a header or a command."""
        limits = self.limits
        tools = [
            {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "returns": t.returns,
                "timeout_s": t.timeout_s or limits.call_timeout_s,
            }
            for t in self.tools.values()
        ]
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
                call_id, name, arguments = parse_call(body)
                await self._slots.acquire()
                task = asyncio.ensure_future(self._answer(call_id, name, arguments, writer, lock))
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
            call_id, name, arguments = parse_call(body)
        except FrameRefused as exc:
            return error_frame(None, "refused", f"not a host tool call: {exc}")
        async with self._slots:
            reply = await self._run(call_id, name, arguments)
        self.calls += 1
        return reply

    async def _answer(
        self,
        call_id: CallId,
        name: str,
        arguments: dict[str, Any],
        writer: asyncio.StreamWriter,
        lock: asyncio.Lock,
    ) -> None:
        reply = await self._run(call_id, name, arguments)
        self.calls += 1
        with contextlib.suppress(ConnectionError):
            await write_frame(writer, lock, reply)

    async def _run(self, call_id: CallId, name: str, arguments: dict[str, Any]) -> bytes:
        tool = self.tools.get(name)
        if tool is None:
            allowed = ", ".join(self.tools) or "none"
            return error_frame(
                call_id,
                "not_allowed",
                f"{name!r} is not a host tool this session may call (it may call: {allowed})",
            )
        problems = tool.argument_errors(arguments)
        if problems:
            return error_frame(call_id, "invalid_arguments", f"{name}: {'; '.join(problems[:10])}")
        limit = tool.timeout_s or self.limits.call_timeout_s
        try:
            async with asyncio.timeout(limit) as scope:
                result = await tool.call(arguments)
        except TimeoutError:
            if scope.expired():
                return error_frame(call_id, "timeout", f"{name} did not finish within {limit:g} s")
            return error_frame(call_id, "tool_error", f"{name} raised TimeoutError")
        except ToolInputError as exc:
            return error_frame(call_id, "invalid_arguments", f"{name}: {exc}")
        except HostToolError as exc:
            return error_frame(call_id, "tool_error", f"{name}: {exc}")
        except Exception as exc:
            log.info("host tool %s raised", name, exc_info=True)
            return error_frame(call_id, "tool_error", f"{type(exc).__name__}: {exc}")
        try:
            body = json.dumps({"id": call_id, "result": to_jsonable_python(result)}).encode()
        except (TypeError, ValueError) as exc:
            return error_frame(
                call_id, "tool_error", f"{name} returned a value that is not JSON: {exc}"
            )
        if len(body) > self.limits.max_result_bytes:
            return error_frame(
                call_id,
                "too_large",
                f"{name} returned {len(body)} bytes, over the limit of "
                f"{self.limits.max_result_bytes}: ask for less (filter, page, summarise)",
            )
        return body
