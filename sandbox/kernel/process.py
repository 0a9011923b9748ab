"""The one thing a backend must provide to the kernel driver: a kernel process it can watch."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class KernelExit:
    """How a kernel process ended, in words a model and a human can act on."""

    reason: str
    exit_code: int | None = None
    signal: int | None = None
    out_of_memory: bool = False

    @classmethod
    def from_returncode(cls, code: int, *, out_of_memory: bool = False) -> KernelExit:
        """Interpret a returncode: negative or >128 means death by a signal (shell convention)."""
        signum = -code if code < 0 else code - 128 if code > 128 else None
        if out_of_memory:
            return cls("out of memory: the sandbox's memory limit was hit", code, signum, True)
        if signum is not None:
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            hint = {
                "SIGSEGV": " (segmentation fault)",
                "SIGKILL": " (killed: possibly out of memory)",
                "SIGABRT": " (aborted)",
                "SIGBUS": " (bus error)",
            }.get(name, "")
            return cls(f"killed by {name}{hint}", code, signum)
        return cls(f"exited with code {code}", code, None)


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
