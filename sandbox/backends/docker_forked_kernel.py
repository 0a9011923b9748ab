"""Docker kernels forked from a kernel zygote (docker_zygote.py), modules already imported.

The engine makes the container exactly as for any kernel (the same options, the same limits),
but runs a holder in it instead of the kernel; the zygote forks the kernel into it, joining its
cgroups and namespaces (kernel_zygote.py). The container, its processes, its limits and how it
is killed are those of any kernel's: commands run beside the kernel as ever, and removing the
container ends the kernel with every other process in it. Its end is told by its keeper, with
its exact status, or is the container's, if that went first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import socket
import time
from pathlib import Path
from typing import Any

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.languages import PYTHON
from sandbox.backends.docker_container import KernelContainer
from sandbox.backends.docker_launcher import ContainerLauncher, ulimits
from sandbox.backends.docker_zygote import DockerZygote
from sandbox.backends.forked_kernel import read_pipe
from sandbox.backends.kernel_zygote import (
    ForkRequest,
    ZygoteFailed,
    forked_or_afresh,
    hear,
    read_only_at_startup,
)
from sandbox.cgroup_oom import OomClock
from sandbox.kernel.process import KernelExit
from sandbox.kernel.stdio_tail import StdioTail
from sandbox.run_to_end import finish_even_if_cancelled

# The holder: the container's command while its kernel is forked into it.
HOLDER = ["/bin/sh", "-c", "exec sleep infinity"]
CGROUP_ROOT = Path("/sys/fs/cgroup")
# What the engine puts first in a container's environment, before its own variables.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The engine's names of rlimits, as the kernel's keeper sets them.
RLIMITS = {
    "nofile": resource.RLIMIT_NOFILE,
    "fsize": resource.RLIMIT_FSIZE,
    "core": resource.RLIMIT_CORE,
}


class ForkingContainerLauncher(ContainerLauncher):
    """A `ContainerLauncher` whose Python kernels the zygote of its image forks."""

    zygote: DockerZygote

    async def launch(self, connection_file_in_sandbox: str) -> KernelContainer:
        if not self._forks():
            return await super().launch(connection_file_in_sandbox)

        async def afresh() -> KernelContainer:
            return await super(ForkingContainerLauncher, self).launch(connection_file_in_sandbox)

        async def forked() -> KernelContainer:
            return await self._fork(connection_file_in_sandbox)

        return await forked_or_afresh(forked, afresh)

    def _forks(self) -> bool:
        """Whether this kernel is forked: Python's, under runc (gVisor's namespaces are not
        the host's to enter), in a sandbox whose containers share a parent cgroup made here
        (the engine is on this machine), with no variable of the session's read only as a
        program starts or a module loads (PYTHONPATH is applied by the kernel itself)."""
        return (
            self.language == PYTHON
            and not self.gvisor
            and self.cgroup_parent is not None
            and not read_only_at_startup(self.spec.env)
        )

    async def _fork(self, connection_file_in_sandbox: str) -> KernelContainer:
        command = self.kernel_command(connection_file_in_sandbox)
        if command[1:3] != ["-m", "ipykernel_launcher"]:
            raise ZygoteFailed(f"not a kernel the zygote can fork: {command[:3]}")
        name = self._next_name()
        options = self._container_options(name, connection_file_in_sandbox, HOLDER)
        kernel = await self._start_container(name, options, ForkedContainerKernel)
        assert isinstance(kernel, ForkedContainerKernel)
        output_read = output_write = pidfd = -1
        control: socket.socket | None = None
        try:  # whatever happens from here on (a cancellation too), nothing of it is left
            init = await asyncio.to_thread(_first_process, kernel.container)
            pidfd = _pidfd(init)
            groups = await asyncio.to_thread(cgroups_of, init)
            # Its pid is the engine's word, read before the pidfd was opened: the process is
            # the container's only if it is in the container's own cgroup.
            if groups["memory"].name != kernel.container.id:
                raise ZygoteFailed("the container's first process is gone")
            request = ForkRequest(
                init=init,
                uid=self.uid,
                argv=command[3:],
                env=environment_of(kernel.container),
                workdir=self.spec.workdir,
                cgroup_procs=[str(group / "cgroup.procs") for group in groups.values()],
                rlimits=[(RLIMITS[which], value) for which, value in ulimits(self.spec.limits)],
                user_namespaces=False,
                groups=await asyncio.to_thread(groups_of, init),
                init_pidfd=pidfd,
            )
            output_read, output_write = os.pipe()
            control, pid = await self.zygote.fork(request, output_write)
            await asyncio.to_thread(_check_cgroups, pid, init)
            await self.zygote.check_image(str(kernel.container.attrs.get("Image") or ""))
            os.close(output_write)
            output_write = -1
            output = await read_pipe(output_read)
            output_read = -1  # the reader's now
            kernel.forked(control, output, OomClock.open(groups["memory"]))
        except BaseException:
            for fd in (output_read, output_write):
                if fd >= 0:
                    os.close(fd)
            if control is not None:
                control.close()
            await finish_even_if_cancelled(kernel.kill())
            raise
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return kernel


def _check_cgroups(kernel: int, init: int) -> None:
    """The kernel is in every cgroup its container's first process is in, each hierarchy's
    (those whose limits hold it, and the rest): else it is killed, and started afresh."""
    try:
        pidfd = os.pidfd_open(kernel)
    except OSError as exc:
        raise ZygoteFailed(f"the forked kernel is gone: {exc}") from None
    try:
        try:
            same = _cgroup_lines(kernel) == _cgroup_lines(init)
        except OSError:
            same = False
        if not same:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            raise ZygoteFailed("the forked kernel is not in its container's every cgroup")
    finally:
        os.close(pidfd)


def _cgroup_lines(pid: int) -> list[str]:
    """Its line of each hierarchy with controllers (v1): those `cgroups_of` joins."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return sorted(line for line in lines if _holds_limits(line.split(":", 2)[1]))


def _holds_limits(controllers: str) -> bool:
    """Whether a hierarchy (named by its /proc/<pid>/cgroup field) has controllers: not
    cgroup v2's unified line, nor a named hierarchy (systemd's), which hold no limit."""
    return bool(controllers) and not controllers.startswith("name=")


def _first_process(container: Any) -> int:
    """The host pid of the container's first process, whose namespaces, cgroups and groups
    are its (all in place before the runtime lets its start return; its exec may not be)."""
    container.reload()
    pid = int(container.attrs.get("State", {}).get("Pid") or 0)
    if pid <= 0:
        raise SandboxStartError("the container ended as it started")
    return pid


def _pidfd(pid: int) -> int:
    try:
        return os.pidfd_open(pid)
    except OSError as exc:
        raise ZygoteFailed(f"the container's first process is gone: {exc}") from None


def environment_of(container: Any) -> dict[str, str]:
    """The environment the engine gives a container's processes (the kernel's, had it been the
    container's command): its HOSTNAME and a PATH, then its own variables, which hold the
    image's (merged in as the container was made). Read from the engine, not from the first
    process, whose exec of its command may not have happened yet when its start returns."""
    config = container.attrs.get("Config") or {}
    env = {"PATH": DEFAULT_PATH, "HOSTNAME": str(config.get("Hostname") or "")}
    for entry in config.get("Env") or []:
        name, sep, value = str(entry).partition("=")
        if sep and name:
            env[name] = value
    return env


def groups_of(pid: int) -> tuple[int, ...]:
    """The supplementary groups of `pid` (the container's first process: the runtime's)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError) as exc:
        raise ZygoteFailed(f"the container's groups cannot be read: {exc}") from None
    raise ZygoteFailed("the container's groups cannot be read")


def cgroups_of(pid: int) -> dict[str, Path]:
    """The directories of the cgroups (v1) `pid` is in, by controller, one per hierarchy."""
    found: dict[str, Path] = {}
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError as exc:
        raise ZygoteFailed(f"the container's cgroups cannot be read: {exc}") from None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not _holds_limits(controllers):
            continue
        mounted = CGROUP_ROOT / controllers
        if not mounted.is_dir():
            continue
        first = controllers.split(",")[0]
        found[first] = mounted / path.lstrip("/")
    if "memory" not in found or "pids" not in found:
        raise ZygoteFailed("the container's memory and pids cgroups (v1) are not found")
    return found


class ForkedContainerKernel(KernelContainer):
    """A kernel the zygote forked into a container that holds it. Killed as any kernel's
    container is (removed, every process in it with it); its end is the keeper's word, or
    the container's death."""

    def __init__(self, container: Any, exited: asyncio.Future[KernelExit]) -> None:
        super().__init__(container, exited)
        self.control: socket.socket | None = None
        self.output: StdioTail | None = None
        self._oom_clock: OomClock | None = None
        self._told: asyncio.Task[None] | None = None

    def forked(
        self, control: socket.socket, output: asyncio.StreamReader, oom_clock: OomClock | None
    ) -> None:
        """The kernel is forked: its keeper's socket, its output, its cgroup's OOM clock."""
        self.control = control
        self.output = StdioTail(output)
        self._oom_clock = oom_clock
        self._told = asyncio.ensure_future(self._hear_the_end(control))

    async def _hear_the_end(self, control: socket.socket) -> None:
        try:
            said = await hear(control, None)
        except (ZygoteFailed, OSError):
            said = {}
        died = time.monotonic()
        status = said.get("status")
        # The keeper gone without a word: its kernel died with it (its parent-death signal).
        code = os.waitstatus_to_exitcode(status) if isinstance(status, int) else -signal.SIGKILL
        if self.output is not None:
            await self.output.settle()  # its last words, for diagnostics()
        oom = None
        if code == -signal.SIGKILL and self._oom_clock is not None:
            oom = self._oom_clock.ran_out_shortly_before(died)
        if not self.exited.done():
            self.exited.set_result(KernelExit.from_returncode(code, out_of_memory=oom))

    async def kill(self) -> None:
        if self._oom_clock is not None:  # before its cgroup goes (which would signal it)
            self._oom_clock.close()
        if self._told is not None:  # its end is this kill's, not what the keeper will say
            self._told.cancel()
            with contextlib.suppress(BaseException):
                await self._told
        try:
            await super().kill()
        finally:
            if self.control is not None:
                self.control.close()
            if self.output is not None:
                self.output.stop()

    def diagnostics(self) -> str:
        told = self.output.text() if self.output is not None else ""
        return told or self.logs
