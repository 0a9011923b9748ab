"""The host's end of a machine sandbox's one channel: the agent's stdio (machine_agent.py).

Everything the host does inside a gVisor machine goes over these two pipes: requests answered
by id, events, and byte streams under credit. What comes back is the sandbox's to write (code
in it may take the agent over), so nothing of it is trusted: a frame over MAX_PAYLOAD, data
beyond the credit granted, a control message that is not a small JSON object, an unknown reply
or too many streams ends the channel, and the sandbox with it (the caller sees `closed`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import socket
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from code_interpreter_wire.errors import SandboxError, SandboxLost
from sandbox.inside_kernel.machine_wire import (
    CLOSE,
    CONTROL,
    CREDIT,
    DATA,
    EOF,
    GRANT,
    HEADER,
    MAX_PAYLOAD,
    MAX_STREAMS,
    VERSION,
    WINDOW,
)
from sandbox.json_depth import nests_deeper_than
from sandbox.run_to_end import finish_even_if_cancelled

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
MAX_UNREAD_BYTES = 8 << 20  # what we wrote and the agent has not read, at most
MAX_EVENTS_PENDING = 1024
_MAX_DEPTH = 8

AcceptHandler = Callable[[str, "ChannelStream"], Awaitable[None]]


class AgentError(SandboxError):
    """The agent refused a request (the message is its reason) or could not be reached."""


@dataclass(frozen=True)
class ChildEnd:
    """How a child of the agent ended."""

    code: int | None
    signal: int | None
    # Whether the machine's own kernel killed it for memory (the agent's word, where its
    # kernel counts OOM kills: a virtual machine's); None where nothing says.
    out_of_memory: bool | None = None


@dataclass(frozen=True)
class Child:
    """A child of the agent as its hello lists it."""

    pid: int
    tag: str
    tty: bool
    end: ChildEnd | None


class ChannelStream:
    """One byte stream through the agent: a connection inside, or a child's stdio."""

    def __init__(self, channel: AgentChannel, sid: int) -> None:
        self._channel = channel
        self.sid = sid
        self._buffer = bytearray()
        self._eof = False
        self._closed = False
        self._credit = WINDOW  # what we may still send
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    @property
    def at_eof(self) -> bool:
        return self._eof and not self._buffer

    async def read(self, limit: int = MAX_PAYLOAD, /) -> bytes:
        """Up to `limit` bytes (all it holds, for a negative one); b"" once the other side
        sent EOF or the stream closed."""
        if limit < 0:
            limit = WINDOW
        while not self._buffer and not self._eof:
            self._readable.clear()
            await self._readable.wait()
        data = bytes(self._buffer[:limit])
        del self._buffer[:limit]
        if data and not self._closed:
            self._channel.send(GRANT, self.sid, CREDIT.pack(len(data)))
        return data

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            while self._credit <= 0 and not self._closed:
                self._writable.clear()
                await self._writable.wait()
            if self._closed:
                raise ConnectionResetError("the stream is closed")
            size = min(len(view), self._credit, MAX_PAYLOAD)
            self._credit -= size
            self._channel.send(DATA, self.sid, bytes(view[:size]))
            view = view[size:]
            await self._channel.drain()

    def write_eof(self) -> None:
        if not self._closed:
            self._channel.send(EOF, self.sid)

    def close(self) -> None:
        if not self._closed:
            self._channel.send(CLOSE, self.sid)
            self._ended()

    def _ended(self) -> None:
        self._closed = self._eof = True
        self._channel.streams.pop(self.sid, None)
        self._readable.set()
        self._writable.set()

    def _received(self, kind: int, payload: bytes) -> None:
        if kind == DATA:
            if len(self._buffer) + len(payload) > WINDOW or self._eof:
                raise ProtocolViolation(f"stream {self.sid} sent beyond its credit")
            self._buffer += payload
            self._readable.set()
        elif kind == EOF:
            self._eof = True
            self._readable.set()
        elif kind == CLOSE:
            self._ended()
        elif kind == GRANT:
            (more,) = CREDIT.unpack(payload)
            if self._credit + more > WINDOW:
                raise ProtocolViolation(f"stream {self.sid} granted beyond its window")
            self._credit += more
            self._writable.set()


class ProtocolViolation(Exception):
    """The agent broke the channel's rules."""


class AgentChannel:
    """Requests, events and streams over one pair of pipes to a machine's agent."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_accept: AcceptHandler | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._on_accept = on_accept
        # Whether the agent serves sudo's askers: said at each hello, so that a machine restored
        # from a template or a pause (whose agent listened) follows the operator's setting now.
        self.root_allowed = True
        self.streams: dict[int, ChannelStream] = {}
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._sids = itertools.count(2, 2)
        self._exits: dict[int, asyncio.Future[ChildEnd]] = {}
        self._accepting: set[asyncio.Task[None]] = set()
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The agent went quiet for a checkpoint: the machine's end that follows is a pause.
        self.detached = False
        self.attached = asyncio.Event()  # set whenever it is not detached
        self.attached.set()
        self.going_on = False  # a save after which it runs on is under way
        # What each hello tells the agent besides (a virtual machine's clock and entropy).
        self.hello_fields: Callable[[], dict[str, Any]] = dict
        self._task = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def over_pipes(
        cls, read_fd: int, write_fd: int, on_accept: AcceptHandler | None = None
    ) -> AgentChannel:
        """The channel over our ends of the agent's stdout and stdin (taken over: closed with
        the channel)."""
        return cls(*await _pipe_streams(read_fd, write_fd), on_accept)

    @classmethod
    async def over_socket(
        cls, sock: socket.socket, on_accept: AcceptHandler | None = None
    ) -> AgentChannel:
        """The channel over a connected stream socket to the agent (a virtual machine's port,
        which its emulator binds to a Unix socket): taken over, closed with the channel."""
        return cls(*await _socket_streams(sock), on_accept)

    async def rebind(self, read_fd: int, write_fd: int) -> None:
        """Go on over new pipes: those of the same machine restored from the checkpoint just
        taken (its agent as it was at the detach). The caller then says `reattach`."""
        await self._rebind(_pipe_streams(read_fd, write_fd))

    async def _rebind(
        self, streams: Coroutine[Any, Any, tuple[asyncio.StreamReader, asyncio.StreamWriter]]
    ) -> None:
        if not self.detached or self.closed.done():
            streams.close()
            raise AgentError("only a detached channel whose machine was saved can be rebound")
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(Exception):
            self._writer.transport.abort()
        self._reader, self._writer = await streams
        self._task = asyncio.ensure_future(self._read_loop())

    # --- requests ---------------------------------------------------------------------------
    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self.detached and op != "hello":
            if not self.going_on:  # saved to stop (or a save given up): it answers no more
                raise AgentError(f"the sandbox's machine is being saved; {op} was not sent")
            with contextlib.suppress(TimeoutError):  # saved to go on: asked once it does
                await asyncio.wait_for(self.until_attached(), REQUEST_TIMEOUT_S)
        if self.closed.done():
            raise SandboxLost(f"the sandbox's agent is gone: {self.closed.result()}")
        rid = next(self._ids)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[rid] = reply
        body = json.dumps({"id": rid, "op": op, **fields}).encode()
        if len(body) > MAX_PAYLOAD:
            raise AgentError(f"a {op} request of {len(body)} bytes is too large")
        try:
            self.send(CONTROL, 0, body)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drain(), REQUEST_TIMEOUT_S)
            either: set[asyncio.Future[Any]] = {reply, self.closed}
            done, _ = await asyncio.wait(
                either, timeout=REQUEST_TIMEOUT_S, return_when=FIRST_COMPLETED
            )
        finally:
            self._replies.pop(rid, None)
        if reply not in done:
            if self.closed.done():
                raise SandboxLost(f"the sandbox's agent is gone: {self.closed.result()}")
            raise AgentError(f"the sandbox's agent did not answer {op} in {REQUEST_TIMEOUT_S} s")
        answer = reply.result()
        if not answer.get("ok"):
            raise AgentError(f"{op} failed inside the sandbox: {str(answer.get('error'))[:500]}")
        return answer

    async def until_attached(self) -> bool:
        """Wait out a detach (a save): whether the agent talks again (False: its machine
        ended, or was saved to stop)."""
        while self.detached and not self.closed.done():
            waiter = asyncio.ensure_future(self.attached.wait())
            try:
                either: set[asyncio.Future[Any]] = {waiter, self.closed}
                await asyncio.wait(either, return_when=FIRST_COMPLETED)
            finally:
                waiter.cancel()
        return not self.closed.done()

    async def hello(self) -> list[Child]:
        answer = await self.request("hello", root=self.root_allowed, **self.hello_fields())
        if answer.get("version") != VERSION:
            raise AgentError(f"the sandbox's agent speaks version {answer.get('version')!r}")
        children = []
        try:
            for item in (answer.get("children") or [])[:MAX_STREAMS]:
                end = item.get("exit")
                code, signum = (None, None) if end is None else (end.get("code"), end.get("signal"))
                children.append(
                    Child(
                        int(item["pid"]),
                        str(item.get("tag") or "")[:64],
                        bool(item.get("tty")),
                        None
                        if end is None
                        else ChildEnd(
                            None if code is None else int(code),
                            None if signum is None else int(signum),
                        ),
                    )
                )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise AgentError(f"the sandbox's agent listed its children wrongly: {exc!r}") from None
        return children

    def open_stream(self) -> ChannelStream:
        if len(self.streams) >= MAX_STREAMS:
            raise AgentError(f"the sandbox has {MAX_STREAMS} streams open already")
        stream = ChannelStream(self, next(self._sids))
        self.streams[stream.sid] = stream
        return stream

    async def connect(self, path: str) -> ChannelStream:
        """A connection to the Unix socket at `path` inside the sandbox."""
        stream = self.open_stream()
        try:
            await self.request("connect", stream=stream.sid, path=path)
        except BaseException:
            stream._ended()
            raise
        return stream

    async def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        uid: int,
        gid: int,
        tag: str,
        marker: str = "",
        separate_stderr: bool = True,
        tty: tuple[int, int] | None = None,
        files: dict[str, tuple[bytes, int]] | None = None,
    ) -> tuple[int, ChannelStream, ChannelStream | None]:
        """Start a child; its pid, its io stream (stdin and stdout, or its terminal) and its
        stderr's stream. `files` are written first (path: (data, mode)), owned by uid."""
        io = self.open_stream()
        err = self.open_stream() if separate_stderr and tty is None else None
        encoded = [
            {"path": p, "data": base64.b64encode(d).decode(), "mode": m}
            for p, (d, m) in (files or {}).items()
        ]
        try:
            answer = await self.request(
                "spawn",
                argv=argv,
                env=env,
                cwd=cwd,
                uid=uid,
                gid=gid,
                tag=tag,
                marker=marker,
                io=io.sid,
                err=None if err is None else err.sid,
                tty=None if tty is None else {"rows": tty[0], "cols": tty[1]},
                files=encoded,
            )
            pid = int(answer["pid"])
        except BaseException:
            for stream in (io, err):
                if stream is not None:
                    stream._ended()
            raise
        return pid, io, err

    async def adopt(
        self, pid: int, *, stderr: bool, replay: bool | Literal["unsent"] = True
    ) -> tuple[ChannelStream, ChannelStream | None]:
        """A child started before (listed by hello), its output on new streams: the last of
        what it wrote first, with `replay` ("unsent": only what it wrote while detached)."""
        io = self.open_stream()
        err = self.open_stream() if stderr else None
        self._exits.setdefault(pid, asyncio.get_running_loop().create_future())
        try:
            await self.request(
                "adopt", pid=pid, io=io.sid, err=None if err is None else err.sid, replay=replay
            )
        except BaseException:
            for stream in (io, err):
                if stream is not None:
                    stream._ended()
            raise
        return io, err

    def _new_exit(self, pid: int) -> asyncio.Future[ChildEnd]:
        """A child's end to come, kept from the moment its pid is known (in the order the
        agent's words arrive: a child may end before the caller reads its start's answer)."""
        if len(self._exits) >= MAX_STREAMS:  # forget those long ended
            for old in [p for p, f in self._exits.items() if f.done()]:
                del self._exits[old]
        future = self._exits[pid] = asyncio.get_running_loop().create_future()
        return future

    async def wait_child(self, pid: int) -> ChildEnd:
        future = self._exits.get(pid)
        if future is None:
            raise AgentError(f"no child {pid} was started here")
        either: set[asyncio.Future[Any]] = {future, self.closed}
        done, _ = await asyncio.wait(either, return_when=FIRST_COMPLETED)
        if future in done:
            return future.result()
        raise SandboxLost(f"the sandbox's agent is gone: {self.closed.result()}")

    async def signal(self, pid: int, signum: int) -> None:
        await self.request("signal", pid=pid, signum=signum)

    async def resize(self, pid: int, rows: int, cols: int) -> None:
        await self.request("resize", pid=pid, rows=rows, cols=cols)

    async def listen(self, path: str, channel: str, *, uid: int, gid: int) -> None:
        await self.request("listen", path=path, channel=channel, uid=uid, gid=gid)

    async def unsaveable(self) -> list[str]:
        """What the machine holds that its gVisor cannot save (network sockets)."""
        reasons = (await self.request("unsaveable")).get("reasons") or []
        return [str(r)[:200] for r in reasons[:16]]

    async def reattach(self) -> None:
        """After a detach that was not followed by a checkpoint: talk again; the children
        that ended meanwhile (their news was not sent) are told ended now."""
        children = await self.hello()
        self.not_detached()
        for child in children:
            future = self._exits.get(child.pid)
            if child.end is not None and future is not None and not future.done():
                future.set_result(child.end)

    def not_detached(self) -> None:
        """The checkpoint that a detach announced did not happen."""
        self.detached = False
        self.attached.set()

    async def detach(self) -> None:
        """Every stream dropped; the agent goes quiet (a checkpoint may follow)."""
        await self.request("detach")
        self.detached = True
        self.attached.clear()
        for stream in list(self.streams.values()):
            stream._ended()

    # --- the wire ---------------------------------------------------------------------------
    def send(self, kind: int, sid: int, payload: bytes = b"") -> None:
        if self.closed.done() or self._writer.is_closing():
            return
        self._writer.write(HEADER.pack(kind, sid, len(payload)) + payload)
        if self._writer.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            # The agent does not read what we send (credit, answers to its events): it is
            # not let to make us hold more.
            log.warning("a machine sandbox's agent stopped reading its channel; closing it")
            self._shut("it stopped reading its channel")

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._writer.drain()

    async def _read_loop(self) -> None:
        """Frames until the pipe ends. Cancelled by `rebind` and `close`, which say what
        follows; an end while detached is a checkpoint's, which a `rebind` may follow."""
        why = "its channel closed (the sandbox ended)"
        try:
            while True:
                head = await self._reader.readexactly(HEADER.size)
                kind, sid, size = HEADER.unpack(head)
                if size > MAX_PAYLOAD:
                    raise ProtocolViolation(f"a frame of {size} bytes")
                payload = await self._reader.readexactly(size) if size else b""
                self._dispatch(kind, sid, payload)
        except asyncio.IncompleteReadError:
            if self.detached:
                return
        except (ProtocolViolation, ValueError, KeyError, TypeError) as exc:
            why = f"it broke the channel's rules ({exc})"
            log.warning("a machine sandbox's agent %s; the channel is closed", why)
        except (ConnectionError, OSError) as exc:
            why = f"its channel failed ({exc})"
        self._shut(why)

    def _dispatch(self, kind: int, sid: int, payload: bytes) -> None:
        if kind == CONTROL:
            self._control(payload)
            return
        if kind not in (DATA, EOF, CLOSE, GRANT) or (kind == GRANT and len(payload) != 4):
            raise ProtocolViolation(f"a frame of kind {kind}")
        stream = self.streams.get(sid)
        if stream is not None:  # else one we closed (ids are never reused): dropped
            stream._received(kind, payload)

    def _control(self, payload: bytes) -> None:
        if nests_deeper_than(payload, _MAX_DEPTH):
            raise ProtocolViolation("a control message nested too deep")
        message = json.loads(payload)
        if not isinstance(message, dict):
            raise ProtocolViolation("a control message that is not an object")
        event = message.get("event")
        if event is None:
            reply = self._replies.get(message.get("id"))  # type: ignore[arg-type]
            if reply is not None and not reply.done():
                if message.get("ok") and "pid" in message:  # a child started
                    self._new_exit(int(message["pid"]))
                reply.set_result(message)
        elif event == "exited":
            future = self._exits.get(int(message["pid"]))
            if future is None or future.done():
                return  # not a child of ours: it was not started by this channel
            code, signum, oom = message.get("code"), message.get("signal"), message.get("oom")
            future.set_result(
                ChildEnd(
                    None if code is None else int(code),
                    None if signum is None else int(signum),
                    None if oom is None else bool(oom),
                )
            )
        elif event == "accepted":
            self._accepted(int(message["stream"]), str(message.get("channel"))[:64])

    def _accepted(self, sid: int, channel: str) -> None:
        if sid % 2 != 1 or sid in self.streams:
            raise ProtocolViolation(f"an accepted stream numbered {sid}")
        stream = ChannelStream(self, sid)
        if self._on_accept is None or len(self.streams) >= MAX_STREAMS:
            self.send(CLOSE, sid)
            return
        self.streams[sid] = stream
        task = asyncio.ensure_future(self._on_accept(channel, stream))
        self._accepting.add(task)
        task.add_done_callback(self._accepting.discard)

    def _shut(self, why: str) -> None:
        if not self.closed.done():
            self.closed.set_result(why)
        for stream in list(self.streams.values()):
            stream._ended()
        with contextlib.suppress(Exception):
            self._writer.transport.abort()  # never waits for an agent that does not read

    async def close(self) -> None:
        self._shut("the host closed it")
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for task in list(self._accepting):
            task.cancel()


async def _pipe_streams(
    read_fd: int, write_fd: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2 * MAX_PAYLOAD, loop=loop)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", buffering=0)
    )
    transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.streams.FlowControlMixin(loop=loop),
        os.fdopen(write_fd, "wb", buffering=0),
    )
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)


async def save_and_go_on(
    channel: AgentChannel, lock: asyncio.Lock, save: Callable[[], Awaitable[None]]
) -> None:
    """Run `save`, a whole save after which the machine runs on: under `lock` (no fresh start
    meanwhile), the channel's requests waiting for it (`going_on`), and finished even if its
    caller leaves (a machine stopped and not running on would be neither running nor saved);
    the cancel goes on after."""

    async def run() -> None:
        async with lock:
            channel.going_on = True
            try:
                await save()
            finally:
                channel.going_on = False

    await finish_even_if_cancelled(run())


async def _socket_streams(
    sock: socket.socket,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    # Not the pipes' transports: a write pipe's transport takes its fd readable as its reader
    # gone, which on a socket is the agent talking.
    return await asyncio.open_unix_connection(sock=sock, limit=2 * MAX_PAYLOAD)


async def bridge(
    stream: ChannelStream,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    moved: Callable[[], None] | None = None,
) -> None:
    """Copy a host connection and a channel stream into each other until both ends are done;
    `moved()` is called each time bytes from the sandbox were taken by the host connection."""

    async def inbound() -> None:  # host connection -> sandbox
        try:
            while data := await reader.read(MAX_PAYLOAD):
                await stream.write(data)
            stream.write_eof()
        except (ConnectionError, OSError):
            stream.close()

    async def outbound() -> None:  # sandbox -> host connection
        try:
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
                if moved is not None:
                    moved()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass

    tasks = [asyncio.ensure_future(inbound()), asyncio.ensure_future(outbound())]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        stream.close()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
