"""The one thing a backend must provide to the kernel driver: a kernel process it can watch."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# Signals a process gets for what it did itself, not sent by anyone: said with their cause.
_FAULTS = {
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted",
    "SIGBUS": "bus error",
    "SIGILL": "illegal instruction",
    "SIGFPE": "arithmetic fault",
    "SIGXCPU": "over its CPU time limit",
    "SIGXFSZ": "a file over the sandbox's file size limit",
}
# A SIGKILL with no evidence either way (no memory cgroup, the engine's report unreadable).
CANNOT_TELL = "from inside the sandbox, or for lack of memory: nothing here can tell which"


@dataclass(frozen=True)
class KernelExit:
    """How a kernel process ended, in words a model and a human can act on. `reason` follows
    "the kernel": "the kernel exited with code 3"."""

    reason: str
    exit_code: int | None = None
    signal: int | None = None
    out_of_memory: bool = False

    @classmethod
    def from_returncode(
        cls, code: int, *, out_of_memory: bool | None = None, killed_from_outside: bool = False
    ) -> KernelExit:
        """Interpret a returncode: negative or >128 means death by a signal (shell convention).

        `out_of_memory` is what the sandbox's own evidence says (an OOM kill just before the
        death, by its memory cgroup or the container engine): True, False, or None where there
        is none. Only a SIGKILL can be the OOM killer's, and memory is blamed only on that
        evidence: a SIGKILL without it was sent by a process in the sandbox (`kill -9 -1` from
        a command), unless `killed_from_outside` (the container engine was asked to kill it,
        as `docker kill` does)."""
        signum = -code if code < 0 else code - 128 if code > 128 else None
        if signum is None:
            return cls(f"exited with code {code}", code, None)
        if out_of_memory and signum == signal.SIGKILL:
            return cls("ran out of memory: the sandbox's memory limit was hit", code, signum, True)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        if name in _FAULTS:
            return cls(f"was killed by {name} ({_FAULTS[name]})", code, signum)
        if killed_from_outside:
            why = "from outside the sandbox (through the container engine)"
            return cls(f"was killed by {name} {why}", code, signum)
        if out_of_memory is None and signum == signal.SIGKILL:
            return cls(f"was killed by {name} ({CANNOT_TELL})", code, signum)
        why = f"a signal from inside the sandbox ({name}), not for lack of memory"
        return cls(f"was killed by {why}", code, signum)


class KernelProcess(Protocol):
    """A running ipykernel, started by a backend with a given connection file."""

    async def wait(self) -> KernelExit:
        """Return when the kernel process has exited, saying how."""
        ...

    async def kill(self) -> None:
        """Kill the kernel and every process it started; return once they are gone."""
        ...

    def diagnostics(self) -> str:
        """The last lines the kernel process wrote outside Jupyter (for start-up failures)."""
        ...


class KernelLauncher(Protocol):
    """Starts kernel processes for one sandbox. Called again to replace a dead kernel."""

    async def launch(self, connection_file_in_sandbox: str) -> KernelProcess:
        """Start the kernel with the connection file at this in-sandbox path."""
        ...

    @property
    def kernel_dir(self) -> Path:
        """The host directory that holds the connection file and the kernel's sockets."""
        ...

    @property
    def kernel_dir_in_sandbox(self) -> str:
        """The same directory as the kernel sees it."""
        ...

    @property
    def kernel_uid(self) -> int | None:
        """The host uid the kernel runs as, which alone may read its connection file; None when
        it is the service's own uid."""
        ...
