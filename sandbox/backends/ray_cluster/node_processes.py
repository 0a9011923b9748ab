"""The session actor's processes: commands, background processes and terminals of the node's
sandbox, served to any service replica (`remote_process.py` is the other end).

The processes themselves stay where they run, in the node's sandbox and its `ManagedProcess`
objects: their output is read there whether anyone listens or not, and kept there within the
same caps as on one machine. A replica only ever holds a snapshot of a process's info and,
while it follows one, a stream of its events.

Why the stream cannot grow the actor's memory: Ray keeps every item a streaming generator
yields until its reader takes it, and without a limit the generator never waits, so a reader
that stalls would let the whole output pile up in Ray's buffers. With
`_generator_backpressure_num_objects` the generator waits once that many items are unread;
what the process writes meanwhile piles up in its listener's backlog instead, which is capped
(`LISTENER_BACKLOG_BYTES`; past it chunks are dropped, counted, and the reader is told with a
`Dropped` event). So one slow reader costs at most that backlog plus `EVENTS_UNREAD` chunks of
at most `CHUNK_BYTES`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import ray

from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest, TerminalSize
from sandbox.processes.managed import KILL_GRACE_S, ProcessEvent

if TYPE_CHECKING:
    from sandbox.backends.base import Sandbox

# Events of one stream a reader may leave unread before the actor's generator waits for it.
EVENTS_UNREAD = 16


class NodeProcesses:
    """Mixin of the session actor: its processes, found by pid, each call counted as activity
    (a stream only while it finds its process: an open terminal alone does not keep a
    session in use, as on one machine)."""

    if TYPE_CHECKING:  # given by the actor this is mixed into
        sandbox: Sandbox

        def activity(self, change: bool = False) -> AbstractAsyncContextManager[object]: ...

    async def start_process(self, request: ProcessRequest) -> ProcessInfo:
        """Start a process that runs on after this call; what it is."""
        async with self.activity(change=True):
            return (await self.sandbox.start_process(request)).info()

    async def run_command(self, request: ProcessRequest) -> CommandResult:
        """Run a command to its end; the caller's ref cancelled (`ray.cancel`) kills it."""
        async with self.activity(change=True):
            return await self.sandbox.run_command(request)

    async def process_info(self, pid: int) -> ProcessInfo:
        """What the process is and whether it runs; `ProcessNotFound` for an unknown pid."""
        async with self.activity():
            return (await self.sandbox.get_process(pid)).info()

    async def list_processes(self, include_ended: bool = False) -> list[ProcessInfo]:
        async with self.activity():
            return await self.sandbox.processes(include_ended=include_ended)

    @ray.method(num_returns="streaming", _generator_backpressure_num_objects=EVENTS_UNREAD)
    async def process_events(self, pid: int, replay: bool = False) -> AsyncIterator[ProcessEvent]:
        """A process's output from now on (`replay`: the most recent kept first), then its
        end; call with `.options(num_returns="streaming")`."""
        async with self.activity():
            events = (await self.sandbox.get_process(pid)).events(replay=replay)
        try:
            async for event in events:
                yield event
        finally:  # the reader left (its generator cancelled): the listener goes now
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def wait_process(self, pid: int) -> CommandResult:
        """Its end and output; waiting keeps the session in use, as on one machine."""
        async with self.activity():
            return await (await self.sandbox.get_process(pid)).wait()

    async def write_stdin(self, pid: int, data: bytes) -> None:
        async with self.activity():
            await (await self.sandbox.get_process(pid)).write_stdin(data)

    async def close_stdin(self, pid: int) -> None:
        async with self.activity():
            await (await self.sandbox.get_process(pid)).close_stdin()

    async def signal_process(self, pid: int, signum: int) -> None:
        async with self.activity():
            await (await self.sandbox.get_process(pid)).signal(signum)

    async def resize(self, pid: int, size: TerminalSize) -> None:
        async with self.activity():
            await (await self.sandbox.get_process(pid)).resize(size)

    async def kill_process(self, pid: int, grace_s: float = KILL_GRACE_S) -> None:
        async with self.activity():
            await (await self.sandbox.get_process(pid)).kill(grace_s)
