"""The session actor's end of the host-tool channel: it listens on the sandbox's channel socket
on the node, and relays each call to whichever service replica asks for calls.

Why a relay: the tools run in the service (they are its callables, its HTTP clients, its MCP
connections), but the sandbox's socket is on the node, and a replica may be on any machine or
none may be connected at all. So the actor keeps what the kernel sends, in a bounded queue, and
replicas take calls with a long poll (`next_tool_calls`) and give answers back
(`answer_tool_call`), which the actor writes on the connection the call came on.

Same rules on the socket as the service's own listener (sandbox/frames.py,
orchestrator/host_tools/channel.py): the peer's uid (and program) is checked, frames are capped
in size and must arrive whole in time, anything but a call frame closes the connection, at
most `MAX_CONNECTIONS` at once. The calls are kept, bounded and timed, by
sandbox/tool_call_queue.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from code_interpreter_wire.errors import SandboxError
from sandbox.frames import (
    FRAME_TIMEOUT_S,
    MAX_CONNECTIONS,
    FrameRefused,
    read_frame,
    refusal_frame,
    write_frame,
)
from sandbox.host_channel import MANIFEST_NAME, HostChannel
from sandbox.tool_call_queue import ToolCallQueue

if TYPE_CHECKING:
    from sandbox.backends.base import Sandbox

log = logging.getLogger(__name__)


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    keys: set[str] = field(default_factory=set)  # its calls not answered yet

    async def deliver(self, body: bytes) -> None:
        """An answer frame (written whole or not at all: a cancel leaves no half frame); a
        connection gone ends, and one not reading in time is ended by the queue's timeout."""
        try:
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                await write_frame(self.writer, self.lock, body)
        except (ConnectionError, TimeoutError):
            self.writer.close()
            raise


class ToolRelay:
    """The relay of one sandbox's channel: its listener, and its calls kept for the service
    (sandbox/tool_call_queue.py)."""

    def __init__(self, channel: HostChannel) -> None:
        self.channel = channel
        self.calls = ToolCallQueue()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    @property
    def closed(self) -> bool:
        return self.calls.closed

    async def open(self) -> None:
        sock = await asyncio.to_thread(self.channel.listen)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    async def set_manifest(self, manifest: bytes) -> None:
        """Take the tools' limits from `manifest` and write it where the kernel reads it."""
        self.calls.set_manifest(manifest)
        await asyncio.to_thread(self.channel.write_file, MANIFEST_NAME, manifest)

    async def next_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        return await self.calls.next_calls(max_wait_s)

    async def answer(self, key: str, body: bytes) -> None:
        await self.calls.answer(key, body)

    async def close(self) -> None:
        """Stop listening, drop every connection and every call not answered."""
        if self._server is not None:
            self._server.close()
            self._server = None
        await self.calls.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connection = _Connection(writer)
        try:
            if not self.channel.peer_allowed(writer.get_extra_info("socket")):
                log.warning("host-tool relay: refused a connection from another uid")
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                await write_frame(writer, connection.lock, refusal_frame("too many connections"))
                return
            self._connections.add(task)
            await self._read_calls(reader, connection)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._connections.discard(task)
            self.calls.forget_group(connection.keys)  # nobody left to answer
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_calls(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        try:
            while True:
                body = await read_frame(
                    reader, max_bytes=self.calls.limits.max_call_bytes, timeout_s=FRAME_TIMEOUT_S
                )
                if body is None:
                    return  # the peer closed between frames: a normal end
                busy = self.calls.offer(body, connection.deliver, connection.keys)
                if busy is not None:
                    await write_frame(connection.writer, connection.lock, busy)
        except FrameRefused as exc:
            log.warning("host-tool relay: refused and closed a connection: %s", exc)
            with contextlib.suppress(ConnectionError):
                await write_frame(connection.writer, connection.lock, refusal_frame(str(exc)))


class NodeToolRelay:
    """Mixin of the session actor: its sandbox's host-tool calls, handed to service replicas.
    Its calls are not counted as the session's activity: a replica polls all the time, and a
    kernel that calls tools is already running code."""

    _tool_relay: ToolRelay | None = None
    _tool_manifest: bytes | None = None

    if TYPE_CHECKING:  # given by the actor this is mixed into
        sandbox: Sandbox

    async def open_tool_relay(self) -> None:
        """Listen on the sandbox's channel socket; nothing to do for a sandbox without one."""
        channel = self.sandbox.host_channel
        if channel is None or self._tool_relay is not None:
            return
        relay = ToolRelay(channel)
        await relay.open()
        self._tool_relay = relay

    async def set_tool_manifest(self, manifest: bytes) -> None:
        """Write the manifest (`ToolChannel.manifest()` of the service) where the kernel reads
        it, and take the calls' size caps and time limits from it."""
        await self._relay().set_manifest(manifest)
        self._tool_manifest = manifest

    async def reopen_tool_relay(self) -> None:
        """The sandbox was replaced by one woken from its image (node_machines.py): listen on
        its channel socket now, with the manifest the service gave the one before."""
        await self.close_tool_relay()
        await self.open_tool_relay()
        if self._tool_relay is not None and self._tool_manifest is not None:
            await self._tool_relay.set_manifest(self._tool_manifest)

    async def next_tool_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        """Calls to answer, as (relay key, call frame body): a long poll of at most
        `max_wait_s` (capped at MAX_POLL_S); at most CALLS_PER_POLL calls and BYTES_PER_POLL
        bytes at once. Each call is given to one poller only."""
        return await self._relay().next_calls(max_wait_s)

    async def answer_tool_call(self, key: str, body: bytes) -> None:
        """The answer to the call `key`: the whole answer frame's body (`ToolChannel.answer`)."""
        await self._relay().answer(key, body)

    async def close_tool_relay(self) -> None:
        if self._tool_relay is not None:
            relay, self._tool_relay = self._tool_relay, None
            await relay.close()

    def _relay(self) -> ToolRelay:
        if self._tool_relay is None:
            raise SandboxError("this session's sandbox has no host-tool channel")
        return self._tool_relay
