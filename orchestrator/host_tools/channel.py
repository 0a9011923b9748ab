"""Serves one session's host-tool calls on the Unix socket in its sandbox's channel directory.

Protocol, both ways: a 4-byte big-endian length, then that many bytes of JSON.
    sandbox -> host   {"id": 7, "tool": "get_expenses", "arguments": {"member_id": "m1"}}
    host -> sandbox   {"id": 7, "result": ...}
                  or  {"id": 7, "error": {"type": "timeout", "message": "..."}}
Many calls may be in flight on one connection; answers come back as they finish.

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
from sandbox.host_channel import MANIFEST_NAME, HostChannel

log = logging.getLogger(__name__)
_MESSAGE_CHARS = 2000  # an error message is for reading, not for carrying data
_MAX_CONNECTIONS = 16  # per session: a kernel, its subprocesses


@dataclass(frozen=True)
class ChannelLimits:
    call_timeout_s: float = 60.0
    max_call_bytes: int = 1 << 20
    max_result_bytes: int = 8 << 20
    max_calls_in_flight: int = 64
    frame_timeout_s: float = 10.0  # a frame begun must end within this: no half-sent frames held


class _Refused(Exception):
    """The peer sent something that is not a call frame: the connection ends."""


class ToolChannel:
    """The listener of one session's channel, with the tools that session may call."""

    def __init__(self, channel: HostChannel, tools: dict[str, HostTool], limits: ChannelLimits):
        self.channel = channel
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
        try:
            if not self.channel.peer_allowed(sock):
                log.warning("host tools: refused a connection from another uid")
                return
            if len(self._connections) >= _MAX_CONNECTIONS:
                await self._send(writer, asyncio.Lock(), _refusal("too many connections"))
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
                try:
                    head = await reader.readexactly(4)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        raise _Refused("a truncated frame") from None
                    return  # the peer closed between frames: a normal end
                size = int.from_bytes(head, "big")
                if size > self.limits.max_call_bytes:
                    raise _Refused(
                        f"a call of {size} bytes is over the limit of {self.limits.max_call_bytes}"
                    )
                try:
                    async with asyncio.timeout(self.limits.frame_timeout_s):
                        body = await reader.readexactly(size)
                except TimeoutError:
                    raise _Refused("a frame that did not arrive whole in time") from None
                except asyncio.IncompleteReadError:
                    raise _Refused("a truncated frame") from None
                call_id, name, arguments = _parse(body)
                await self._slots.acquire()
                task = asyncio.ensure_future(self._answer(call_id, name, arguments, writer, lock))
                calls.add(task)
                task.add_done_callback(calls.discard)
                # Released when the task ends in any way: one cancelled before it ran included.
                task.add_done_callback(lambda _: self._slots.release())
        except _Refused as exc:
            log.warning("host tools: refused and closed a connection: %s", exc)
            with contextlib.suppress(ConnectionError):
                await self._send(writer, lock, _refusal(str(exc)))
        finally:
            for task in calls:
                task.cancel()

    async def _answer(
        self,
        call_id: int | str,
        name: str,
        arguments: dict[str, Any],
        writer: asyncio.StreamWriter,
        lock: asyncio.Lock,
    ) -> None:
        reply = await self._run(call_id, name, arguments)
        self.calls += 1
        with contextlib.suppress(ConnectionError):
            await self._send(writer, lock, reply)

    async def _run(self, call_id: int | str, name: str, arguments: dict[str, Any]) -> bytes:
        tool = self.tools.get(name)
        if tool is None:
            allowed = ", ".join(self.tools) or "none"
            return _error(
                call_id,
                "not_allowed",
                f"{name!r} is not a host tool this session may call (it may call: {allowed})",
            )
        problems = tool.argument_errors(arguments)
        if problems:
            return _error(call_id, "invalid_arguments", f"{name}: {'; '.join(problems[:10])}")
        limit = tool.timeout_s or self.limits.call_timeout_s
        try:
            async with asyncio.timeout(limit) as scope:
                result = await tool.call(arguments)
        except TimeoutError:
            if scope.expired():
                return _error(call_id, "timeout", f"{name} did not finish within {limit:g} s")
            return _error(call_id, "tool_error", f"{name} raised TimeoutError")
        except ToolInputError as exc:
            return _error(call_id, "invalid_arguments", f"{name}: {exc}")
        except HostToolError as exc:
            return _error(call_id, "tool_error", f"{name}: {exc}")
        except Exception as exc:
            log.info("host tool %s raised", name, exc_info=True)
            return _error(call_id, "tool_error", f"{type(exc).__name__}: {exc}")
        try:
            body = json.dumps({"id": call_id, "result": to_jsonable_python(result)}).encode()
        except (TypeError, ValueError) as exc:
            return _error(call_id, "tool_error", f"{name} returned a value that is not JSON: {exc}")
        if len(body) > self.limits.max_result_bytes:
            return _error(
                call_id,
                "too_large",
                f"{name} returned {len(body)} bytes, over the limit of "
                f"{self.limits.max_result_bytes}: ask for less (filter, page, summarise)",
            )
        return body

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, lock: asyncio.Lock, body: bytes) -> None:
        async with lock:
            writer.write(len(body).to_bytes(4, "big") + body)
            await writer.drain()


def _parse(body: bytes) -> tuple[int | str, str, dict[str, Any]]:
    """A call frame, exactly; anything else is refused."""
    try:
        frame = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _Refused("a frame that is not JSON") from None
    if not isinstance(frame, dict) or set(frame) != {"id", "tool", "arguments"}:
        raise _Refused("a frame that is not {id, tool, arguments}")
    call_id, name, arguments = frame["id"], frame["tool"], frame["arguments"]
    valid_id = (isinstance(call_id, int) and not isinstance(call_id, bool) and call_id >= 0) or (
        isinstance(call_id, str) and 0 < len(call_id) <= 64
    )
    if not valid_id:
        raise _Refused("a call id that is not a small number or short string")
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise _Refused("a tool name that is not a short string")
    if not isinstance(arguments, dict):
        raise _Refused("arguments that are not an object")
    return call_id, name, arguments


def _error(call_id: int | str | None, kind: str, message: str) -> bytes:
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + " [...]"
    return json.dumps({"id": call_id, "error": {"type": kind, "message": message}}).encode()


def _refusal(why: str) -> bytes:
    return _error(None, "refused", f"the host tool channel refused the connection: {why}")
