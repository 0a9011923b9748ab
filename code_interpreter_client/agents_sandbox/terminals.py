"""One of the model's command sessions (the SDK's unified exec): a background process of the
sandbox whose output is gathered here, within a bound, until the model polls for it."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from code_interpreter_client.agents_sandbox.errors import TRANSPORT_ERRORS
from code_interpreter_client.code_session import CodeSession
from code_interpreter_wire.processes import ProcessEnd, ProcessOutput

# What one terminal session keeps for the model between its polls; older output is dropped.
TERMINAL_BUFFER_BYTES = 1 << 20
TERMINAL_DROPPED = b"\n[... earlier output dropped: it was not read in time ...]\n"


@dataclass
class Terminal:
    """One of the model's running command sessions: a background process of the sandbox, its
    output gathered here (bounded) until the model polls for it."""

    pid: int
    tty: bool
    chunks: deque[bytes] = field(default_factory=deque)
    buffered: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    notify: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end: ProcessEnd | None = None
    follower: asyncio.Task[None] | None = None
    last_used: float = field(default_factory=time.monotonic)

    async def add(self, data: bytes) -> None:
        async with self.lock:
            self.chunks.append(data)
            self.buffered += len(data)
            # Drop the oldest output, leaving one marker in its place.
            while self.buffered > TERMINAL_BUFFER_BYTES and len(self.chunks) > 2:
                if self.chunks[0] is TERMINAL_DROPPED:
                    self.buffered -= len(self.chunks.popleft())
                self.buffered -= len(self.chunks.popleft())
                self.chunks.appendleft(TERMINAL_DROPPED)
                self.buffered += len(TERMINAL_DROPPED)
        self.notify.set()

    async def follow(self, code: CodeSession) -> None:
        try:
            async for event in code.process_events(self.pid, replay=True):
                if isinstance(event, ProcessOutput):
                    await self.add(event.data)
                else:
                    self.end = event
        except TRANSPORT_ERRORS as exc:  # the session went away: the process with it
            self.end = ProcessEnd(exit_code=None, error=f"lost the process: {exc}")
        finally:
            self.ended.set()
            self.notify.set()
