"""Aggregate limits for local sandboxes through cgroup v1: memory (no swap), pids and CPU.

Each sandbox gets `<controller>/code-interpreter/<sandbox id>` in the memory, pids and cpu
hierarchies. The kernel's process joins them before it drops privileges, so everything it starts
is counted, and an OOM kill is told apart from other deaths by the memory cgroup's counter.
Needs root and writable cgroup v1 hierarchies; `available()` says whether this machine has them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from sandbox.spec import ResourceLimits

ROOT = Path("/sys/fs/cgroup")
PARENT = "code-interpreter"
log = logging.getLogger(__name__)
_CONTROLLERS = ("memory", "pids", "cpu")


def available() -> bool:
    return os.geteuid() == 0 and all(
        (ROOT / c / "cgroup.procs").exists() and os.access(ROOT / c, os.W_OK) for c in _CONTROLLERS
    )


class SandboxCgroup:
    def __init__(self, sandbox_id: str) -> None:
        self.dirs = [ROOT / c / PARENT / sandbox_id for c in _CONTROLLERS]

    @property
    def memory(self) -> Path:
        return self.dirs[0]

    def create(self, limits: ResourceLimits) -> None:
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        memory = str(limits.memory_mb << 20)
        (self.memory / "memory.limit_in_bytes").write_text(memory)
        swap = self.memory / "memory.memsw.limit_in_bytes"
        if swap.exists():  # only where swap accounting is on
            swap.write_text(memory)
        (self.dirs[1] / "pids.max").write_text(str(limits.pids))
        period = 100_000
        (self.dirs[2] / "cpu.cfs_period_us").write_text(str(period))
        (self.dirs[2] / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * period)))

    def join_self(self) -> None:
        """Move the calling process here (run in the child before it execs)."""
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as f:
                f.write("0")

    def oom_kills(self) -> int:
        try:
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    async def wait_empty(self, wait_s: float = 5.0) -> bool:
        """Wait until none of the sandbox's processes is left. The processes of a PID namespace
        die after its init, not with it; a kernel started before they are gone would find the
        pids limit still taken by them (a fork bomb's children, say) and fail to start."""
        procs = self.dirs[1] / "cgroup.procs"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if not procs.read_text().strip():
                    return True
            except OSError:  # the group is gone: nothing is left in it
                return True
            if time.monotonic() > deadline:
                log.warning("processes of %s outlived its kernel by %g s", self.dirs[1], wait_s)
                return False
            await asyncio.sleep(0.02)

    def remove(self, wait_s: float = 3.0) -> None:
        """Remove the groups, waiting for killed processes to finish exiting (blocking)."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("could not remove cgroup %s: still in use", d)
                        break
                    time.sleep(0.02)
