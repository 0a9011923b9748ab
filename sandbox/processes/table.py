"""A sandbox's processes: started through its backend's spawner, found by pid, all ended with
the sandbox. How many may run at once, and how many ended ones are remembered, is bounded."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from code_interpreter_wire.errors import ProcessLimitReached, ProcessNotFound
from code_interpreter_wire.processes import CommandResult, ProcessInfo, ProcessRequest
from sandbox.processes.managed import ManagedProcess
from sandbox.processes.spawned import SpawnedProcess, Spawner

MAX_RUNNING = 32  # processes started through the API at once, per sandbox
REMEMBERED_ENDED = 16  # ended ones kept (their result only) for `list`, `wait` and reconnecting


class ProcessTable:
    def __init__(self, spawner: Spawner, *, output_limit_chars: int) -> None:
        self._spawner = spawner
        self._output_limit_chars = output_limit_chars
        self._processes: OrderedDict[int, ManagedProcess] = OrderedDict()
        self._starting = 0
        self._started = 0  # every start ever asked for
        self._closed = False

    @property
    def spawner(self) -> Spawner:
        """The one spawner of the sandbox's processes (closed with the table)."""
        return self._spawner

    async def start(self, request: ProcessRequest) -> ManagedProcess:
        if self._closed:
            raise ProcessNotFound("the sandbox is closed")
        running = sum(1 for p in self._processes.values() if p.running) + self._starting
        if running >= MAX_RUNNING:
            raise ProcessLimitReached(
                f"{MAX_RUNNING} processes already run in this sandbox; wait for one to end, "
                "or kill one"
            )
        self._starting += 1
        self._started += 1
        try:
            spawned = await self._spawner.spawn(request)
        finally:
            self._starting -= 1
        process = ManagedProcess(spawned, request, output_limit_chars=self._output_limit_chars)
        if self._closed:  # the sandbox closed while it started: it ends with it
            await process.close()
            raise ProcessNotFound("the sandbox closed while the process started")
        self._processes.pop(process.pid, None)  # a pid reused after an old one ended
        self._processes[process.pid] = process
        self._forget_old()
        return process

    def adopt(self, spawned: SpawnedProcess, request: ProcessRequest) -> ManagedProcess:
        """A process the sandbox already runs (its machine was restored with it)."""
        process = ManagedProcess(spawned, request, output_limit_chars=self._output_limit_chars)
        self._processes[process.pid] = process
        self._started += 1
        return process

    def running(self) -> list[ManagedProcess]:
        return [p for p in self._processes.values() if p.running]

    async def run(self, request: ProcessRequest) -> CommandResult:
        """Start it and wait for its end."""
        process = await self.start(request)
        try:
            return await process.wait()
        except asyncio.CancelledError:  # the caller left: so does its command
            await process.kill(grace_s=0.5)
            raise

    def activity(self) -> int | None:
        """None while a process starts or runs; else how many were ever started (so a change
        says one ran since). A process can kill the kernel: the kernel driver checks it."""
        if self._starting or any(p.running for p in self._processes.values()):
            return None
        return self._started

    def get(self, pid: int) -> ManagedProcess:
        process = self._processes.get(pid)
        if process is None:
            raise ProcessNotFound(f"process with pid {pid} not found")
        return process

    def find(self, tag: str) -> ManagedProcess:
        for process in reversed(self._processes.values()):
            if process.request.tag == tag:
                return process
        raise ProcessNotFound(f"process with tag {tag!r} not found")

    def list(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        return [p.info() for p in self._processes.values() if include_ended or p.running]

    def _forget_old(self) -> None:
        ended = [pid for pid, p in self._processes.items() if not p.running]
        for pid in ended[: max(0, len(ended) - REMEMBERED_ENDED)]:
            del self._processes[pid]

    async def close(self) -> None:
        """Kill every process; the sandbox is going away."""
        self._closed = True
        await asyncio.gather(*(p.close() for p in self._processes.values()), return_exceptions=True)
        await self._spawner.close()
