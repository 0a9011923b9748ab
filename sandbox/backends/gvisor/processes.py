"""Processes in a machine: children of its agent, as the sandbox's uid, in their own session.

The agent starts them with pipes or a terminal it holds inside the machine, so they live on
through a checkpoint and restore; their output goes to the host while a host listens, and the
last of it is kept inside for the host that takes them over after a restore (`adopt`). A signal
goes to the process's group and to every process carrying its marker (what left the group).
"""

from __future__ import annotations

import contextlib
import posixpath
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

from code_interpreter_wire.errors import FileMissing, SandboxError, SandboxLost
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.backends.gvisor.agent_channel import (
    AgentChannel,
    AgentError,
    ChannelStream,
    ChildEnd,
)
from sandbox.inside_kernel.machine_root import root_environment
from sandbox.processes.spawned import SpawnedProcess, Spawner, merged

PROCESS_TAG = "process"


class MachineProcess(SpawnedProcess):
    def __init__(
        self,
        channel: AgentChannel,
        pid: int,
        io: ChannelStream,
        err: ChannelStream | None,
        terminal: bool,
    ) -> None:
        self.pid = pid
        self._channel = channel
        self._io = io
        self._err = err
        self._terminal = terminal

    async def output(self) -> AsyncIterator[tuple[Stream, bytes]]:
        """Its output to its end. A save of its machine drops its streams; once the machine
        runs on, it is followed again, and what it wrote meanwhile comes first."""
        first: Stream = "pty" if self._terminal else "stdout"
        while True:
            sources: dict[Stream, ChannelStream] = {first: self._io}
            if self._err is not None:
                sources["stderr"] = self._err
            async for item in merged(sources):
                yield item
            channel = self._channel
            if not channel.detached or not await channel.until_attached():
                return
            try:
                self._io, self._err = await channel.adopt(
                    self.pid, stderr=not self._terminal, replay="unsent"
                )
            except (AgentError, SandboxLost):  # it ended meanwhile, and is gone
                return

    async def write_stdin(self, data: bytes) -> None:
        await self._io.write(data)

    async def close_stdin(self) -> None:
        self._io.write_eof()

    async def signal(self, signum: int) -> None:
        with contextlib.suppress(AgentError, SandboxLost):  # gone already, or with its machine
            await self._channel.signal(self.pid, signum)

    async def resize(self, size: TerminalSize) -> None:
        if self._terminal:
            await self._channel.resize(self.pid, size.rows, size.cols)

    async def wait(self) -> ProcessEnd:
        try:
            end = await self._channel.wait_child(self.pid)
        except SandboxLost as exc:
            return ProcessEnd(exit_code=None, error=f"its sandbox ended: {exc}")
        return process_end(end)


def process_end(end: ChildEnd) -> ProcessEnd:
    if end.out_of_memory:  # the machine's own kernel said so (a virtual machine's)
        error = "it was killed for lack of memory: the sandbox ran out of its memory limit"
        return ProcessEnd(exit_code=None, signal=end.signal or 9, error=error)
    if end.signal is not None:
        return ProcessEnd(exit_code=None, signal=end.signal, error=f"killed by signal {end.signal}")
    code = end.code or 0
    return ProcessEnd(exit_code=code, error=None if code == 0 else f"exited with code {code}")


class MachineSpawner(Spawner):
    def __init__(
        self,
        channel: Callable[[], Awaitable[AgentChannel]],
        uid: int,
        environment: Callable[[], dict[str, str]],
    ) -> None:
        self._channel = channel
        self._uid = uid
        self._environment = environment

    async def spawn(self, request: ProcessRequest) -> MachineProcess:
        channel = await self._channel()
        size = request.terminal
        env = {**self._environment(), **request.env}
        # Root is the machine's (gVisor is the wall): for installs, as E2B's user="root".
        uid = 0 if request.user == "root" else self._uid
        if uid == 0:
            env = root_environment(env, explicit=request.env.keys())
        if size is not None:
            env.setdefault("TERM", "xterm-256color")
        try:
            pid, io, err = await channel.spawn(
                request.full_argv(),
                env=env,
                # A relative directory is the workspace's, as a command's `cd` would take it.
                cwd=posixpath.join(WORKSPACE_IN_SANDBOX, request.cwd or ""),
                uid=uid,
                gid=uid,
                tag=PROCESS_TAG,
                marker=secrets.token_hex(12),
                separate_stderr=True,
                tty=None if size is None else (size.rows, size.cols),
            )
        except AgentError as exc:
            if "FileNotFoundError" in str(exc) or "NotADirectoryError" in str(exc):
                raise FileMissing(
                    f"the process did not start: its program or working directory is missing "
                    f"({exc})"
                ) from None
            raise SandboxError(f"the process did not start: {exc}") from None
        return MachineProcess(channel, pid, io, err, size is not None)

    async def adopt(self, pid: int, *, terminal: bool, replay: bool = True) -> MachineProcess:
        """A process the machine runs already (it was restored with it): its output from now
        on, after the last of what it wrote before with `replay`."""
        channel = await self._channel()
        io, err = await channel.adopt(pid, stderr=not terminal, replay=replay)
        return MachineProcess(channel, pid, io, err, terminal)
