"""What a backend hands over once a process runs inside its sandbox: the one thing each backend
implements. Everything after (caps, subscribers, time limits) is `ManagedProcess`."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize

CHUNK_BYTES = 32 << 10  # read at most this much of a stream at once


class SpawnedProcess(ABC):
    """A process running inside a sandbox, with its output pipes (or terminal) held here."""

    pid: int  # its pid inside the sandbox, where the backend knows it

    @abstractmethod
    def output(self) -> AsyncIterator[tuple[Stream, bytes]]:
        """Its output as it comes, every stream, until all of them are closed."""

    @abstractmethod
    async def write_stdin(self, data: bytes) -> None:
        """Send input (to the terminal, for a process in one)."""

    @abstractmethod
    async def close_stdin(self) -> None:
        """End its input: it reads EOF."""

    @abstractmethod
    async def signal(self, signum: int) -> None:
        """Send a signal to it and to every process it started."""

    @abstractmethod
    async def resize(self, size: TerminalSize) -> None:
        """Change its terminal's size."""

    @abstractmethod
    async def wait(self) -> ProcessEnd:
        """Its end: exit status or signal."""


class Spawner(ABC):
    """Starts processes inside one sandbox; each backend's sandbox provides one."""

    @abstractmethod
    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        """Start `request` inside the sandbox, with the kernel's environment (the session's
        variables included) and then the request's; in the workspace unless it names a cwd.
        Raise SandboxError with the reason if it cannot start."""

    async def close(self) -> None:  # noqa: B027 - most spawners hold nothing between starts
        """Release what it holds between starts; the sandbox is closing (its processes were
        killed already)."""


class ByteSource(Protocol):
    """What `merged` reads: an asyncio.StreamReader, or a stream of a machine's channel."""

    async def read(self, n: int = -1, /) -> bytes: ...


async def merged(readers: Mapping[Stream, ByteSource]) -> AsyncIterator[tuple[Stream, bytes]]:
    """Chunks of several streams, in the order they arrive, until every one ends."""
    queue: asyncio.Queue[tuple[Stream, bytes] | None] = asyncio.Queue(maxsize=len(readers) * 2)

    async def pump(name: Stream, reader: ByteSource) -> None:
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                await queue.put((name, chunk))
        except OSError:  # a terminal's master reads EIO once the process side is closed
            pass
        # Its end, told only when it ended by itself: cancelled, nobody reads the queue any
        # more, and waiting for room there would never end.
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(name, reader)) for name, reader in readers.items()]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
