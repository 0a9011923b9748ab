"""What a caller holds of one process: the same whether the process runs here
(`ManagedProcess`) or in a sandbox on another machine (the ray backend's `RemoteProcess`).

The service reaches a process only through this, so a session served by any replica of a
cluster drives its processes the same way as one served in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from code_interpreter_wire.processes import CommandResult, ProcessInfo, TerminalSize
from sandbox.processes.managed import KILL_GRACE_S, ProcessEvent


class ProcessHandle(Protocol):
    """One process of a sandbox, found by its pid."""

    @property
    def pid(self) -> int: ...

    def info(self) -> ProcessInfo:
        """What it is and whether it runs (for a remote process: as of when it was found)."""
        ...

    def events(self, *, replay: bool = False) -> AsyncIterator[ProcessEvent]:
        """Its output from this call on (`replay`: the most recent kept first), then its end."""
        ...

    async def wait(self) -> CommandResult:
        """Its end and its output, kept within the output limits."""
        ...

    async def write_stdin(self, data: bytes) -> None: ...

    async def close_stdin(self) -> None: ...

    async def signal(self, signum: int) -> None: ...

    async def resize(self, size: TerminalSize) -> None: ...

    async def kill(self, grace_s: float = KILL_GRACE_S) -> None:
        """SIGTERM to it and everything it started, SIGKILL to what is left after `grace_s`."""
        ...
