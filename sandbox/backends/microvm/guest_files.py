"""A machine's workspace files, through its agent: the workspace is a disk inside the machine.

The same operations, `Entry` values and typed errors as sandbox/workspace_files.py's
`Workspace`, which reaches files in a host directory; here each is a request to the agent
(inside_kernel/machine_files.py says them), the bytes on a stream of the channel under its
credit, so a big file is never whole in memory on either side. What the agent sends is the
sandbox's to write (code in it may take the agent over): sizes, counts and entries are checked,
and nothing beyond the caller's `max_bytes` (or a listing's caps) is ever held.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast

from code_interpreter_wire.errors import (
    FileAccessError,
    FileMissing,
    FileTooLarge,
    InvalidPath,
    SandboxError,
    SandboxLost,
)
from sandbox.backends.gvisor.agent_channel import (
    REQUEST_TIMEOUT_S,
    AgentChannel,
    AgentError,
    ChannelStream,
)
from sandbox.inside_kernel.machine_files import (
    FULL,
    INVALID_PATH,
    LIST_LIMIT,
    MAX_LIST_BYTES,
    MISSING,
    TOO_LARGE,
)
from sandbox.workspace_files import Entry
from sandbox.workspace_paths import clean_path

ChannelGetter = Callable[[], Awaitable[AgentChannel]]

# How long the agent may leave a stream silent while it owes us bytes.
IDLE_TIMEOUT_S = REQUEST_TIMEOUT_S
CHUNK = 1 << 20  # what is read from, or gathered for, a host file at a time
_MAX_ANSWER = 64 << 10  # a write's answer on its stream: one small JSON object
_MAX_PATH = 1 << 20  # a listed path, at most (4096 levels of 255 bytes, escaped)
_REFUSALS: dict[str, type[SandboxError]] = {
    INVALID_PATH: InvalidPath,
    MISSING: FileMissing,
    TOO_LARGE: FileTooLarge,
    FULL: FileTooLarge,  # what the host's Workspace raises for ENOSPC and EDQUOT too
}
_KINDS = ("file", "directory", "symlink", "other")


class GuestWorkspace:
    """The workspace of one machine, as the sandbox's user (`uid`, `gid`) owns it."""

    def __init__(self, channel: ChannelGetter, uid: int, gid: int) -> None:
        """`channel`: the machine's channel now (a restart may replace it)."""
        self._channel = channel
        self.uid = uid
        self.gid = gid

    # --- reading ----------------------------------------------------------------------------
    async def read(self, path: str, max_bytes: int) -> bytes:
        data = bytearray()

        async def take(chunk: bytes) -> None:
            data.extend(chunk)

        await self._read_into(path, max_bytes, take)
        return bytes(data)

    async def copy_out(self, path: str, sink_path: Path, max_bytes: int) -> int:
        """Copy a file into `sink_path` a chunk at a time; return its size."""
        sink = await asyncio.to_thread(sink_path.open, "wb")
        gathered = bytearray()

        async def take(chunk: bytes) -> None:
            gathered.extend(chunk)
            if len(gathered) >= CHUNK:
                await asyncio.to_thread(sink.write, bytes(gathered))
                gathered.clear()

        try:
            size = await self._read_into(path, max_bytes, take)
            await asyncio.to_thread(sink.write, bytes(gathered))
        finally:
            await asyncio.to_thread(sink.close)
        return size

    async def _read_into(
        self, path: str, max_bytes: int, take: Callable[[bytes], Awaitable[None]]
    ) -> int:
        parts = clean_path(path)
        channel = await self._channel()
        stream = channel.open_stream()
        try:
            answer = await _ask(
                channel, "file_read", path="/".join(parts), stream=stream.sid, max_bytes=max_bytes
            )
            size = answer.get("size")
            if not isinstance(size, int) or size < 0:
                raise AgentError(f"the sandbox's agent gave {path!r} the size {size!r}")
            if size > max_bytes:
                raise FileTooLarge(f"{path!r} is {size} bytes; the limit is {max_bytes}")
            total = 0
            while chunk := await _next(stream):
                total += len(chunk)
                if total > max_bytes:
                    raise FileTooLarge(f"{path!r} grew past the limit of {max_bytes} bytes")
                await take(chunk)
            if total < size:
                _lost(channel)
                raise FileAccessError(f"{path!r} shrank or failed while it was read; try again")
            return total
        finally:
            stream.close()

    async def list_dir(
        self, path: str = "", *, recursive: bool = False, limit: int = LIST_LIMIT
    ) -> list[Entry]:
        """Entries under `path`, at most `limit`: depth first, sorted within each directory."""
        top = clean_path(path, allow_root=True)
        limit = max(0, min(limit, LIST_LIMIT))
        channel = await self._channel()
        stream = channel.open_stream()
        try:
            await _ask(
                channel,
                "file_list",
                path="/".join(top),
                recursive=recursive,
                limit=limit,
                stream=stream.sid,
            )
            entries: list[Entry] = []
            pending = bytearray()
            total = 0
            while chunk := await _next(stream):
                total += len(chunk)
                if total > MAX_LIST_BYTES:
                    raise AgentError("the sandbox's agent sent a listing over its size")
                if b"\n" not in chunk:  # no line ends here: nothing to split yet
                    pending += chunk
                    continue
                pending += chunk
                *lines, rest = pending.split(b"\n")
                for line in lines:
                    entries.append(_entry(_json_object(line, "a listing")))
                if len(entries) > limit:
                    raise AgentError("the sandbox's agent listed more entries than asked for")
                pending = bytearray(rest)
            if pending:
                _lost(channel)
                raise AgentError("the sandbox's agent cut a listing short")
            return entries
        finally:
            stream.close()

    async def stat(self, path: str) -> Entry:
        """What is at `path` (a symlink itself, never what it points at)."""
        parts = clean_path(path, allow_root=True)
        channel = await self._channel()
        return _entry_in(await _ask(channel, "file_stat", path="/".join(parts)))

    # --- writing ----------------------------------------------------------------------------
    async def write(self, path: str, data: bytes) -> Entry:
        """Write a file; return what is now there."""
        view = memoryview(data)
        at = 0

        async def next_chunk() -> bytes:
            nonlocal at
            piece = bytes(view[at : at + CHUNK])
            at += len(piece)
            return piece

        return await self._write_from(path, next_chunk)

    async def copy_in(self, path: str, source_path: Path) -> Entry:
        """Write a file from `source_path`, a chunk at a time; return what is now there."""
        source = cast(BinaryIO, await asyncio.to_thread(source_path.open, "rb"))
        try:
            return await self._write_from(path, lambda: asyncio.to_thread(source.read, CHUNK))
        finally:
            await asyncio.to_thread(source.close)

    async def _write_from(self, path: str, next_chunk: Callable[[], Awaitable[bytes]]) -> Entry:
        parts = clean_path(path)
        channel = await self._channel()
        stream = channel.open_stream()
        try:
            await _ask(
                channel,
                "file_write",
                path="/".join(parts),
                stream=stream.sid,
                uid=self.uid,
                gid=self.gid,
                mode=None,
            )
            # The agent answers on the stream once the file is in place, or at once if a write
            # fails (a full disk): then the rest is not sent.
            answering = asyncio.ensure_future(_answer_on(stream))
            answering.add_done_callback(_retrieved)
            try:
                sent_all = False
                while not answering.done():
                    chunk = await next_chunk()
                    if not chunk:
                        sent_all = True
                        break
                    await stream.write(chunk)
                stream.write_eof()
                answer = await asyncio.wait_for(answering, IDLE_TIMEOUT_S)
            except ConnectionResetError:
                _lost(channel)
                raise AgentError(f"the sandbox's agent cut the writing of {path!r} off") from None
            except TimeoutError:
                raise AgentError(
                    f"the sandbox's agent did not say how {path!r} was written"
                ) from None
            except AgentError:
                _lost(channel)
                raise
            finally:
                answering.cancel()
            _raise_refusal(answer)
            if not sent_all:
                raise AgentError(f"the sandbox's agent answered before {path!r} was written")
            entry = _entry_in(answer)
            return Entry("/".join(parts), "file", entry.size, entry.mtime)
        finally:
            stream.close()

    async def mkdir(self, path: str) -> Entry:
        """A directory (and its parents) made if missing, the sandbox user's."""
        parts = clean_path(path)
        channel = await self._channel()
        answer = await _ask(channel, "file_mkdir", path="/".join(parts), uid=self.uid, gid=self.gid)
        return _entry_in(answer)

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink (never what it points at) or a directory tree of any depth."""
        parts = clean_path(path)
        channel = await self._channel()
        await _ask(channel, "file_remove", path="/".join(parts))


async def _ask(channel: AgentChannel, op: str, **fields: Any) -> dict[str, Any]:
    answer = await channel.request(op, **fields)
    _raise_refusal(answer)
    return answer


def _raise_refusal(answer: dict[str, Any]) -> None:
    """A refusal the agent answered (machine_files.Refused), as the typed error it is."""
    kind = answer.get("refused")
    if kind is not None:
        error = _REFUSALS.get(str(kind), FileAccessError)
        raise error(str(answer.get("message"))[:500])


async def _next(stream: ChannelStream) -> bytes:
    try:
        return await asyncio.wait_for(stream.read(), IDLE_TIMEOUT_S)
    except TimeoutError:
        raise AgentError(f"the sandbox's agent sent nothing for {IDLE_TIMEOUT_S} s") from None


async def _answer_on(stream: ChannelStream) -> dict[str, Any]:
    data = bytearray()
    while chunk := await stream.read():
        data += chunk
        if len(data) > _MAX_ANSWER:
            raise AgentError("the sandbox's agent answered a write at too great a length")
    return _json_object(bytes(data), "an answer to a write")


def _json_object(data: bytes | bytearray, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise AgentError(f"the sandbox's agent sent {what} that is not a JSON object")
    return value


def _entry_in(answer: dict[str, Any]) -> Entry:
    item = answer.get("entry")
    if not isinstance(item, dict):
        raise AgentError("the sandbox's agent answered without an entry")
    return _entry(item)


def _entry(item: dict[str, Any]) -> Entry:
    """An entry as the agent sent it, checked."""
    path, kind, size = item.get("path"), item.get("kind"), item.get("size")
    mtime, escaped = item.get("mtime"), item.get("escaped", False)
    if (
        not isinstance(path, str)
        or len(path) > _MAX_PATH
        or kind not in _KINDS
        or not isinstance(size, int)
        or isinstance(size, bool)
        or size < 0
        or not isinstance(mtime, int | float)
        or not math.isfinite(mtime)
        or not isinstance(escaped, bool)
    ):
        raise AgentError(f"the sandbox's agent sent an entry that is not one: {str(item)[:200]}")
    return Entry(
        path, cast(Literal["file", "directory", "symlink", "other"], kind), size, mtime, escaped
    )


def _retrieved(task: asyncio.Future[Any]) -> None:
    """A write's answer left unawaited (the write failed first) is not logged as lost."""
    if not task.cancelled():
        task.exception()


def _lost(channel: AgentChannel) -> None:
    """A stream that ended short because the channel did: say that, not a file's fault."""
    if channel.closed.done():
        raise SandboxLost(f"the sandbox's agent is gone: {channel.closed.result()}")
