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
most `MAX_CONNECTIONS` at once. Bounded in memory: at most `MAX_UNANSWERED` calls (queued or
taken, not answered yet) per session, each within the manifest's call size; past the cap a
call is answered at once with a `busy` error. The kernel never waits forever: a call nobody
takes within its tool's time limit is answered with a `timeout` error by the relay itself, as
is one taken and not answered within `ANSWER_GRACE_S` past that limit (its replica died).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from code_interpreter_wire.errors import SandboxClosed, SandboxError
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

if TYPE_CHECKING:
    from sandbox.backends.base import Sandbox

log = logging.getLogger(__name__)

MAX_UNANSWERED = 64  # calls of one session queued or taken and not answered yet
CALLS_PER_POLL = 16  # at most this many calls in one answer of `next_tool_calls`...
BYTES_PER_POLL = 4 << 20  # ...and this many bytes (one call is always given, whatever its size)
MAX_POLL_S = 30.0  # the longest a poll waits: a replica gone leaves no call waiting long
ANSWER_GRACE_S = 2.0  # past its time limit, a call taken has this long to be answered
MAX_MANIFEST_BYTES = 4 << 20
# Until the service writes the manifest: ChannelLimits' defaults.
DEFAULT_CALL_TIMEOUT_S = 60.0
DEFAULT_MAX_CALL_BYTES = 1 << 20
DEFAULT_MAX_RESULT_BYTES = 8 << 20


@dataclass(frozen=True)
class RelayLimits:
    """What the manifest says the calls may take: size caps and time limits."""

    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S
    max_call_bytes: int = DEFAULT_MAX_CALL_BYTES
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES
    tool_timeouts: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, manifest: bytes) -> RelayLimits:
        """The limits of a manifest written by `ToolChannel.manifest()`; SandboxError if it
        is not one."""
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise SandboxError(
                f"the host-tool manifest is {len(manifest)} bytes, over {MAX_MANIFEST_BYTES}"
            )
        try:
            body = json.loads(manifest)
            timeout = float(body["timeout_s"])
            call_bytes = int(body["max_call_bytes"])
            result_bytes = int(body["max_result_bytes"])
            tools = {str(t["name"]): float(t["timeout_s"] or timeout) for t in body["tools"]}
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise SandboxError(f"not a host-tool manifest: {exc!r}") from None
        if min(timeout, *tools.values()) <= 0 or call_bytes <= 0 or result_bytes <= 0:
            raise SandboxError("a host-tool manifest with a limit that is not positive")
        return cls(timeout, call_bytes, result_bytes, tools)

    def timeout_of(self, tool: str) -> float:
        return self.tool_timeouts.get(tool, self.call_timeout_s)


@dataclass
class _Call:
    key: str
    body: bytes
    call_id: CallId
    tool: str
    connection: _Connection
    taken: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    keys: set[str] = field(default_factory=set)


class ToolRelay:
    """The relay of one sandbox's channel: its listener, its queue, its calls in flight."""

    def __init__(self, channel: HostChannel) -> None:
        self.channel = channel
        self.limits = RelayLimits()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._unanswered: dict[str, _Call] = {}
        self._queue: deque[str] = deque()  # keys of calls not taken yet, oldest first
        self._queued = asyncio.Event()
        self._sends: set[asyncio.Task[None]] = set()
        self._keys = (f"{secrets.token_hex(4)}-{n}" for n in itertools.count())
        self.closed = False

    async def open(self) -> None:
        sock = await asyncio.to_thread(self.channel.listen)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    async def set_manifest(self, manifest: bytes) -> None:
        """Take the tools' limits from `manifest` and write it where the kernel reads it."""
        self.limits = RelayLimits.from_manifest(manifest)
        await asyncio.to_thread(self.channel.write_file, MANIFEST_NAME, manifest)

    async def next_calls(self, max_wait_s: float) -> list[tuple[str, bytes]]:
        """Calls not taken yet, oldest first, as (key, call frame); waits up to `max_wait_s`
        (at most MAX_POLL_S) for one; [] if none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(max_wait_s, 0.0), MAX_POLL_S)
        while not self._queue:
            if self.closed:
                raise SandboxClosed("the host-tool relay is closed")
            self._queued.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queued.wait(), remaining)
        taken: list[tuple[str, bytes]] = []
        size = 0
        while self._queue and len(taken) < CALLS_PER_POLL:
            call = self._unanswered[self._queue[0]]
            if taken and size + len(call.body) > BYTES_PER_POLL:
                break
            self._queue.popleft()
            call.taken = True
            taken.append((call.key, call.body))
            size += len(call.body)
        return taken

    async def answer(self, key: str, body: bytes) -> None:
        """Write `body`, the whole answer frame of the call `key`, to the connection it came
        on. An answer over the manifest's result cap becomes a `too_large` error; one for a
        call already answered (timed out, or its connection gone) is dropped."""
        call = self._unanswered.get(key)
        if call is None:
            return
        limit = self.limits.max_result_bytes
        if len(body) > limit:
            body = error_frame(
                call.call_id,
                "too_large",
                f"{call.tool} returned {len(body)} bytes, over the limit of {limit}: ask for "
                "less (filter, page, summarise)",
            )
        await self._finish(call, body)

    async def close(self) -> None:
        """Stop listening, drop every connection and every call not answered."""
        self.closed = True
        self._queued.set()  # pollers waiting wake and find it closed
        if self._server is not None:
            self._server.close()
            self._server = None
        for call in list(self._unanswered.values()):
            self._forget(call)
        tasks = [*self._connections, *self._sends]
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
            for key in list(connection.keys):  # nobody left to answer
                self._forget(self._unanswered[key])
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_calls(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        try:
            while True:
                body = await read_frame(
                    reader, max_bytes=self.limits.max_call_bytes, timeout_s=FRAME_TIMEOUT_S
                )
                if body is None:
                    return  # the peer closed between frames: a normal end
                call_id, tool, _ = parse_call(body)
                if len(self._unanswered) >= MAX_UNANSWERED:
                    busy = error_frame(
                        call_id,
                        "busy",
                        f"{MAX_UNANSWERED} host tool calls of this session already wait for "
                        "an answer; wait for some to finish, then call again",
                    )
                    await write_frame(connection.writer, connection.lock, busy)
                    continue
                self._enqueue(_Call(next(self._keys), body, call_id, tool, connection))
        except FrameRefused as exc:
            log.warning("host-tool relay: refused and closed a connection: %s", exc)
            with contextlib.suppress(ConnectionError):
                await write_frame(connection.writer, connection.lock, refusal_frame(str(exc)))

    def _enqueue(self, call: _Call) -> None:
        loop = asyncio.get_running_loop()
        limit = self.limits.timeout_of(call.tool)
        call.timer = loop.call_later(limit, self._time_is_up, call, limit)
        self._unanswered[call.key] = call
        call.connection.keys.add(call.key)
        self._queue.append(call.key)
        self._queued.set()

    def _time_is_up(self, call: _Call, limit: float) -> None:
        if self._unanswered.get(call.key) is not call:
            return
        if call.taken and limit > 0:
            # Taken: its replica runs the tool under the same limit; give its answer a moment.
            loop = asyncio.get_running_loop()
            call.timer = loop.call_later(ANSWER_GRACE_S, self._time_is_up, call, 0.0)
            return
        why = (
            "no service took the call"
            if not call.taken
            else "the service that took the call did not answer"
        )
        budget = self.limits.timeout_of(call.tool)
        body = error_frame(
            call.call_id, "timeout", f"{call.tool} was not answered within {budget:g} s: {why}"
        )
        task = asyncio.ensure_future(self._finish(call, body))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def _finish(self, call: _Call, body: bytes) -> None:
        """Answer the call once: it leaves the books first, so nothing answers it twice."""
        self._forget(call)
        connection = call.connection
        try:
            async with asyncio.timeout(FRAME_TIMEOUT_S):
                await write_frame(connection.writer, connection.lock, body)
        except (ConnectionError, TimeoutError):  # gone, or not reading: it ends
            connection.writer.close()

    def _forget(self, call: _Call) -> None:
        if self._unanswered.pop(call.key, None) is None:
            return
        if call.timer is not None:
            call.timer.cancel()
        call.connection.keys.discard(call.key)
        if not call.taken:
            with contextlib.suppress(ValueError):
                self._queue.remove(call.key)


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
