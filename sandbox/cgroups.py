"""Aggregate limits for local sandboxes through cgroup v1: memory (no swap), pids and CPU.

Each sandbox gets `<controller>/code-interpreter/<sandbox id>` in the memory, pids and cpu
hierarchies. The kernel's process joins them before it drops privileges, so everything it starts
is counted, and an OOM kill is told apart from other deaths by the memory cgroup's counter.
Needs root and writable cgroup v1 hierarchies; `available()` says whether this machine has them.

A process started beside the kernel (sandbox/backends/local_processes.py) also gets a group of
its own under the sandbox's in the pids hierarchy (`ProcessCgroup`): still counted against the
sandbox's limits, and the one reliable list of everything it started, even what left its session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path

from code_interpreter_wire.spec import ResourceLimits

ROOT = Path("/sys/fs/cgroup")
PARENT = "code-interpreter"
log = logging.getLogger(__name__)
_CONTROLLERS = ("memory", "pids", "cpu")
# cpu.shares of a sandbox warming up in a pool, and of a live one (cgroup v1's default): a
# warming sandbox gets what a live session leaves, and 1/17 when both want all of it; never
# starved, so a preload (seconds of imports) ends well within its time limit on a busy host.
BACKGROUND_SHARES = 64
LIVE_SHARES = 1024
MAX_SHARES = 262_144  # cgroup v1's most
CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000
_RESCALING = threading.Lock()  # called from the event loop and from worker threads


def available() -> bool:
    return os.geteuid() == 0 and all(
        (ROOT / c / "cgroup.procs").exists() and os.access(ROOT / c, os.W_OK) for c in _CONTROLLERS
    )


class SandboxCgroup:
    def __init__(self, sandbox_id: str, *, scale_parent: bool = False) -> None:
        self.sandbox_id = sandbox_id
        self.dirs = [ROOT / c / PARENT / sandbox_id for c in _CONTROLLERS]
        # Whether its coming, going and weight rescale the parent's weight (rescale_parent).
        self.scale_parent = scale_parent

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
        (self.dirs[2] / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        self.set_cpu_quota(limits.cpus)
        if self.scale_parent:
            rescale_parent(joining=self.sandbox_id)

    def set_cpu_quota(self, cpus: float) -> None:
        """At most `cpus` cores' time, whatever runs in the group."""
        quota = max(MIN_QUOTA_US, int(cpus * CFS_PERIOD_US))  # the kernel's least
        (self.dirs[2] / "cpu.cfs_quota_us").write_text(str(quota))

    def weigh(self, *, background: bool) -> bool:
        """The sandbox's CPU weight among its siblings: background (a warm pool's sandbox
        warming up, which yields the CPU to live sessions') or a live session's (the cgroup
        default). False where the group is not there (no limits made for this sandbox)."""
        try:
            (self.dirs[2] / "cpu.shares").write_text(
                str(BACKGROUND_SHARES if background else LIVE_SHARES)
            )
        except FileNotFoundError:
            return False
        if self.scale_parent:
            rescale_parent()
        return True

    def join_self(self, pids_group: Path | None = None) -> None:
        """Move the calling process here (run in the child before it execs); in the pids
        hierarchy, into `pids_group` (a kernel's own, inside this one) if given."""
        for d in self.dirs:
            target = pids_group if pids_group is not None and d == self.dirs[1] else d
            with open(target / "cgroup.procs", "w") as f:
                f.write("0")

    def kernel_group(self, language: str) -> Path:
        """A kernel's own group in the pids hierarchy, inside the sandbox's (whose limit it
        shares): what it leaves behind can be waited for apart from the other kernels."""
        path = self.dirs[1] / f"kernel-{language}"
        path.mkdir(exist_ok=True)
        return path

    def oom_kills(self) -> int:
        try:
            for line in (self.memory / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    async def wait_empty(self, wait_s: float = 5.0, group: Path | None = None) -> bool:
        """Wait until none of the sandbox's processes is left. The processes of a PID namespace
        die after its init, not with it; a kernel started before they are gone would find the
        pids limit still taken by them (a fork bomb's children, say) and fail to start."""
        # pids.current counts the whole subtree: the processes of commands (in their own
        # groups below this one) as well as the kernel's.
        current = (group or self.dirs[1]) / "pids.current"
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if int(current.read_text().strip() or 0) == 0:
                    return True
            except OSError:  # the group is gone: nothing is left in it
                return True
            if time.monotonic() > deadline:
                log.warning("processes of %s outlived its kernel by %g s", self.dirs[1], wait_s)
                return False
            await asyncio.sleep(0.02)

    def process_group(self) -> ProcessCgroup:
        """A new, empty group for one process and all it starts, inside this sandbox's."""
        group = ProcessCgroup(self.dirs[1] / f"process-{secrets.token_hex(6)}")
        group.path.mkdir()
        return group

    def remove(self, wait_s: float = 3.0) -> None:
        """Remove the groups (the processes' groups inside first), waiting for killed processes
        to finish exiting (blocking)."""
        deadline = time.monotonic() + wait_s
        inner = [p for p in self.dirs[1].glob("process-*") if p.is_dir()]
        inner += [p for p in self.dirs[1].glob("kernel-*") if p.is_dir()]
        for d in [*inner, *self.dirs]:
            _remove_group_dir(d, deadline)
        if self.scale_parent:
            rescale_parent()


def remove_groups_of(sandbox_ids: list[str], wait_s: float = 0.5) -> None:
    """The groups of sandboxes a dead service left (blocking), where groups are made at all."""
    if available():
        for sandbox_id in sandbox_ids:
            SandboxCgroup(sandbox_id).remove(wait_s)


def rescale_parent(parent: Path = ROOT / "cpu" / PARENT, *, joining: str = "") -> int | None:
    """Weigh the sandboxes' parent group among the host's processes as that many live sessions:
    LIVE_SHARES for each live sandbox under it (at least one's; warming ones add nothing), and
    at most one per core (more sessions than cores cannot use more than every core: beyond
    that the weight would only starve the service that relays their output). With one fixed
    weight, a host's whole fleet of sessions got the CPU of one process beside a busy host's
    others (a first chart took 0.69x a raw kernel's when the host was quiet, 1.59x when it was
    loaded). The weight set, or None where there is no parent group or it could not be set
    (best effort: a sandbox never fails for it). Several services on one host share the parent
    and count each other's; within one, the count and the write are one step. A sandbox is live
    while its group holds a process (the pids hierarchy's count, which takes in the containers'
    groups below a Docker sandbox's), or as it is made (`joining`, before its kernel joins):
    a group left empty by a crash counts for nothing."""
    with _RESCALING:
        live = 0
        try:
            for child in parent.iterdir():
                with contextlib.suppress(OSError, ValueError):  # one going away as it is read
                    if int((child / "cpu.shares").read_text()) >= LIVE_SHARES:
                        live += child.name == joining or _holds_processes(child)
            most = min(MAX_SHARES, LIVE_SHARES * (os.cpu_count() or 1))
            shares = min(most, LIVE_SHARES * max(1, live))
            (parent / "cpu.shares").write_text(str(shares))
        except FileNotFoundError:
            return None
        except OSError:
            log.exception("the sandboxes' parent cgroup could not be weighed")
            return None
        return shares


def _holds_processes(cpu_group: Path) -> bool:
    """Whether the sandbox whose cpu group this is holds a process now; where there is no pids
    group of the same name to ask (a group made by hand), it is taken to."""
    try:
        return (
            int((ROOT / "pids" / cpu_group.relative_to(ROOT / "cpu") / "pids.current").read_text())
            > 0
        )
    except (OSError, ValueError):
        return True


def remove_engine_parents(sandbox_id: str, wait_s: float = 3.0) -> None:
    """Remove what a container engine made under a sandbox's group in every controller (it
    makes the parent in each hierarchy it uses, and removes only the containers' own)."""
    deadline = time.monotonic() + wait_s
    for d in sorted(ROOT.glob(f"*/{PARENT}/{sandbox_id}")):
        if not d.is_symlink():
            _remove_group_dir(d, deadline)


def _remove_group_dir(d: Path, deadline: float) -> None:
    """Remove one group once its last process has finished exiting, waiting until `deadline`."""
    while d.is_dir():
        try:
            d.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                log.warning("could not remove cgroup %s: still in use", d)
                return
            time.sleep(0.02)


class ProcessCgroup:
    """One process's group in the pids hierarchy: what it started cannot leave it (the sandbox
    has no cgroup filesystem), so signalling every member reaches all of them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add(self, pid: int) -> None:
        """Move `pid` (a host pid) here; done before it runs anything of its own."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def members(self) -> list[int]:
        try:
            return [int(line) for line in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):  # removed: nothing is left in it
            return []

    def signal(self, signum: int) -> int:
        """Send `signum` to every member; return how many were found. Each is pinned by a
        pidfd and checked to still be a member, so a pid reused meanwhile is never signalled."""
        found = 0
        member_line = f":pids:/{self.path.relative_to(ROOT / 'pids')}\n"
        for pid in self.members():
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(pid)
                try:
                    if member_line in Path(f"/proc/{pid}/cgroup").read_text():
                        found += 1
                        signal.pidfd_send_signal(pidfd, signum)
                finally:
                    os.close(pidfd)
        return found

    async def kill_all(self, wait_s: float = 10.0) -> bool:
        """SIGKILL every member until none is left (a fork bomb keeps forking meanwhile)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not await asyncio.to_thread(self.signal, signal.SIGKILL) and not self.members():
                return True
            await asyncio.sleep(0.02)
        log.warning("processes of %s outlived %g s of SIGKILL", self.path, wait_s)
        return False

    def remove(self) -> bool:
        """Remove the group if it is empty; say whether it is gone."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True
