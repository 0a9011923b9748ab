"""One process followed from start to end: its output kept within caps, handed to whoever
listens, its time limit kept, and its end recorded.

Its output is always read, whether anyone listens or not, so a background process never blocks
on a full pipe; what is kept of it is bounded three ways: the result keeps the head and tail of
each stream (the same markers as executions), a replay buffer keeps the most recent bytes for a
client that reconnects, and each listener's backlog is capped (past it, chunks are dropped and
counted, and the listener is told).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import signal
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.processes import (
    CommandResult,
    ProcessEnd,
    ProcessInfo,
    ProcessOutput,
    ProcessRequest,
    Stream,
    TerminalSize,
)
from sandbox.kernel.collector import CappedText
from sandbox.processes.spawned import SpawnedProcess

REPLAY_BYTES = 256 << 10  # the most recent output a reconnecting client is given
LISTENER_BACKLOG_BYTES = 4 << 20  # what one slow listener may leave queued
KILL_GRACE_S = 2.0  # SIGTERM first, then SIGKILL this much later
KILL_RETRIES = 5  # SIGKILLs again at a time limit, while it has not ended (~1 min in all)


@dataclass(frozen=True)
class Dropped:
    """Output a listener missed because it read more slowly than the process wrote."""

    chunks: int
    bytes: int


ProcessEvent = ProcessOutput | ProcessEnd | Dropped


class _Listener:
    def __init__(self) -> None:
        self.queue: deque[ProcessEvent] = deque()
        self.queued_bytes = 0
        self.dropped_chunks = 0
        self.dropped_bytes = 0
        self.ready = asyncio.Event()

    def put(self, event: ProcessEvent) -> None:
        size = len(event.data) if isinstance(event, ProcessOutput) else 0
        if size and self.queued_bytes + size > LISTENER_BACKLOG_BYTES:
            self.dropped_chunks += 1
            self.dropped_bytes += size
            return
        if self.dropped_chunks:  # tell it what it missed, in order, before what follows
            self.queue.append(Dropped(self.dropped_chunks, self.dropped_bytes))
            self.dropped_chunks = self.dropped_bytes = 0
        self.queue.append(event)
        self.queued_bytes += size
        self.ready.set()


class ManagedProcess:
    def __init__(
        self, spawned: SpawnedProcess, request: ProcessRequest, *, output_limit_chars: int
    ) -> None:
        self.spawned = spawned
        self.request = request
        self.pid = spawned.pid
        self.started = time.monotonic()
        self.end: ProcessEnd | None = None
        self._timed_out = False
        self._texts = {
            name: CappedText(name, output_limit_chars) for name in ("stdout", "stderr", "pty")
        }
        self._decoders = {
            name: codecs.getincrementaldecoder("utf-8")("replace") for name in self._texts
        }
        self._replay: deque[ProcessOutput] = deque()
        self._replay_bytes = 0
        self._listeners: set[_Listener] = set()
        self._finished = asyncio.Event()
        self._task = asyncio.ensure_future(self._follow())
        self._deadline: asyncio.TimerHandle | None = None
        self._killer: asyncio.Future[None] | None = None
        self._final: CommandResult | None = None
        if request.timeout_s is not None:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(request.timeout_s, self._time_is_up)

    # --- following it
    async def _follow(self) -> None:
        try:
            async for stream, data in self.spawned.output():
                self._record(stream, data)
            end = await self.spawned.wait()
        except Exception as exc:  # the backend lost it: say so, never hang a waiter
            end = ProcessEnd(exit_code=None, error=f"the process was lost: {exc}")
        if self._timed_out:
            limit = round(self.request.timeout_s or 0.0, 2)  # a deadline's 0.9997 s reads "1 s"
            end = end.model_copy(
                update={"timed_out": True, "error": f"killed after its time limit of {limit:g} s"}
            )
        self.end = end
        if self._deadline is not None:
            self._deadline.cancel()
        for name, decoder in self._decoders.items():
            self._texts[name].append(decoder.decode(b"", final=True))
        # Ended, it keeps its result (the texts at their capped size) and its replay buffer
        # (at most REPLAY_BYTES), so a client that follows it only now still reads its output.
        self._final = self.result()
        self._texts.clear()
        for listener in self._listeners:
            listener.put(end)
        self._listeners.clear()  # each has its end; one never read is not kept alive here
        self._finished.set()

    def _record(self, stream: Stream, data: bytes) -> None:
        self._texts[stream].append(self._decoders[stream].decode(data))
        chunk = ProcessOutput(stream=stream, data=data)
        self._replay.append(chunk)
        self._replay_bytes += len(data)
        while self._replay_bytes > REPLAY_BYTES and len(self._replay) > 1:
            self._replay_bytes -= len(self._replay.popleft().data)
        for listener in self._listeners:
            listener.put(chunk)

    def _time_is_up(self) -> None:
        self._timed_out = True
        self._killer = asyncio.ensure_future(self._end_at_time_limit())

    async def _end_at_time_limit(self) -> None:
        """Kill it, then SIGKILL again, backing off, while it has not ended: a kill the sandbox
        hindered (it can stop or kill a backend's signaller, which runs as its own uid) is tried
        again rather than leaving it to outlive its limit."""
        await self.kill()
        for attempt in range(KILL_RETRIES):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(self._finished.wait()), KILL_GRACE_S * 2**attempt
                )
            if self.end is not None:
                return
            with contextlib.suppress(ProcessLookupError, OSError, SandboxError):
                await self.spawned.signal(signal.SIGKILL)

    # --- what callers do with it
    @property
    def running(self) -> bool:
        return self.end is None

    async def kill(self, grace_s: float = KILL_GRACE_S) -> None:
        """SIGTERM to it and everything it started; after `grace_s` (or as soon as it ended),
        SIGKILL to whatever is left: what it started may ignore SIGTERM and outlive it."""
        if self.end is not None:
            return
        with contextlib.suppress(ProcessLookupError, OSError, SandboxError):
            await self.spawned.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._finished.wait()), grace_s)
        with contextlib.suppress(ProcessLookupError, OSError, SandboxError):
            await self.spawned.signal(signal.SIGKILL)

    async def signal(self, signum: int) -> None:
        if self.end is None:
            await self.spawned.signal(signum)

    async def write_stdin(self, data: bytes) -> None:
        await self.spawned.write_stdin(data)

    async def close_stdin(self) -> None:
        await self.spawned.close_stdin()

    async def resize(self, size: TerminalSize) -> None:
        await self.spawned.resize(size)

    async def wait(self) -> CommandResult:
        await self._finished.wait()
        return self.result()

    def result(self) -> CommandResult:
        if self._final is not None:
            return self._final
        end = self.end or ProcessEnd(exit_code=None, error="still running")
        stdout, stdout_dropped = self._texts["stdout"].value()
        stderr, stderr_dropped = self._texts["stderr"].value()
        terminal, terminal_dropped = self._texts["pty"].value()
        return CommandResult(
            pid=self.pid,
            exit_code=end.exit_code,
            signal=end.signal,
            timed_out=end.timed_out,
            error=end.error,
            stdout=stdout + terminal,
            stderr=stderr,
            stdout_dropped=stdout_dropped + terminal_dropped,
            stderr_dropped=stderr_dropped,
            duration_s=time.monotonic() - self.started,
        )

    def events(self, *, replay: bool = False) -> AsyncIterator[ProcessEvent]:
        """Its output from now on, that is from this call, not from the first read (`replay`:
        first the most recent output kept), then its end."""
        listener = _Listener()
        if replay:
            for chunk in self._replay:
                listener.put(chunk)
        if self.end is not None:
            listener.put(self.end)
        else:
            self._listeners.add(listener)
        return self._drain(listener)

    async def _drain(self, listener: _Listener) -> AsyncIterator[ProcessEvent]:
        try:
            while True:
                while listener.queue:
                    event = listener.queue.popleft()
                    if isinstance(event, ProcessOutput):
                        listener.queued_bytes -= len(event.data)
                    yield event
                    if isinstance(event, ProcessEnd):
                        return
                listener.ready.clear()
                await listener.ready.wait()
        finally:
            self._listeners.discard(listener)

    def info(self) -> ProcessInfo:
        r = self.request
        return ProcessInfo(
            pid=self.pid,
            argv=r.full_argv(),
            command=r.command,
            env=r.env,
            cwd=r.cwd,
            tag=r.tag,
            terminal=r.terminal is not None,
            running=self.running,
            end=self.end,
        )

    async def close(self) -> None:
        """Kill it (if it runs) and stop following it."""
        await self.kill(grace_s=0.5)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._finished.wait()), 5.0)
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
