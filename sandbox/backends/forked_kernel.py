"""Local kernels forked from the kernel zygote (kernel_zygote.py), modules already imported.

bwrap makes the sandbox exactly as for any local kernel, but runs a holder in it (a shell that
says it is up, then sleeps) instead of the kernel; the zygote forks the kernel into it. The
sandbox, its processes, its limits and how it is killed are those of any local kernel; only
Python's kernel is forked (the other languages' are started as ever).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import ResourceLimits
from sandbox.backends.bwrap_kernel import BwrapKernel, BwrapLauncher, confine, rlimits
from sandbox.backends.kernel_zygote import (
    SINGLE_THREADED,
    ForkRequest,
    KernelZygote,
    forked_or_afresh,
    hear,
    read_only_at_startup,
)
from sandbox.cgroup_oom import OomClock
from sandbox.cgroups import SandboxCgroup
from sandbox.egress_channel import with_forwarder
from sandbox.kernel.command import kernel_environment
from sandbox.kernel.stdio_tail import StdioTail
from sandbox.run_to_end import finish_even_if_cancelled

# The holder: bwrap's command in a sandbox whose kernel is forked into it. It says it runs (so
# the sandbox is whole: mounts made, root pivoted) on what bwrap passes as its output.
HOLDER = ["/bin/sh", "-c", "echo ready; exec sleep infinity"]
HOLDER_READY = b"ready\n"
HOLDER_TIMEOUT_S = 60.0


def zygote_environment(python: str, home: Path) -> dict[str, str]:
    """The zygote's environment while it imports: a kernel's (some modules read theirs at
    import), one thread for every maths library (a process with threads cannot be forked
    safely, and these start theirs at import), and `home`, its own, which no sandbox sees
    (matplotlib keeps its font list there)."""
    path = f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin"
    env = kernel_environment(path=path, home=str(home), limits=ResourceLimits(), extra={})
    return env | SINGLE_THREADED


class ForkingLauncher(BwrapLauncher):
    """A `BwrapLauncher` whose Python kernels the zygote forks."""

    zygote: KernelZygote

    async def launch(self, connection_file_in_sandbox: str) -> BwrapKernel:
        if not self._forks():
            return await super().launch(connection_file_in_sandbox)

        async def afresh() -> BwrapKernel:
            return await super(ForkingLauncher, self).launch(connection_file_in_sandbox)

        async def forked() -> BwrapKernel:
            return await self._fork(connection_file_in_sandbox)

        return await forked_or_afresh(forked, afresh)

    def _forks(self) -> bool:
        """Whether this kernel is forked: Python's, in a sandbox with a cgroup (without one,
        its memory rlimit would count the zygote's heap, which the kernel inherits), and no
        variable of the session's read only as a program starts or a module loads, which the
        zygote did long before (PYTHONPATH is applied by the kernel itself)."""
        return (
            not self.unsafe
            and self.language == PYTHON
            and self.cgroup is not None
            and not read_only_at_startup(self.spec.env)
        )

    async def _fork(self, connection_file_in_sandbox: str) -> BwrapKernel:
        command = self.programs.kernels.command(
            PYTHON, connection_file_in_sandbox, self.kernel_dir_in_sandbox, self.spec.limits
        )
        if command[1:3] != ["-m", "ipykernel_launcher"]:
            raise SandboxStartError(f"not a kernel the zygote can fork: {command[:3]}")
        pids_group = self.cgroup.kernel_group(self.language) if self.cgroup else None
        proc = await self._start_holder(pids_group)
        assert proc.stdout is not None
        held: BwrapKernel | None = None
        control: socket.socket | None = None
        output_read = output_write = -1
        try:  # whatever happens from here on (a cancellation too), nothing of it is left
            try:  # read before anything else reads bwrap's output
                ready = await asyncio.wait_for(proc.stdout.readline(), HOLDER_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            # The sandbox as any local kernel's, to kill it the same way if the fork fails.
            held = BwrapKernel(proc, self.cgroup, group=pids_group, init_first=True)
            if ready != HOLDER_READY:
                await held.output.settle()
                said = (ready.decode(errors="replace") + held.diagnostics()).strip()
                raise SandboxStartError(f"the sandbox did not start: {said or 'it ended'}")
            assert self.host_uid is not None
            request = ForkRequest(
                init=_sole_child(proc.pid),
                uid=self.host_uid,
                argv=command[3:],
                env=self.environment(),
                workdir=self.spec.workdir,
                cgroup_procs=self._cgroup_procs(pids_group),
                rlimits=rlimits(self.spec.limits, self.cgroup, self.host_uid),
            )
            output_read, output_write = os.pipe()
            control, _ = await self.zygote.fork(request, output_write)
            os.close(output_write)
            output_write = -1
            output = await read_pipe(output_read)
            output_read = -1  # the reader's now
        except BaseException:
            for fd in (output_read, output_write):
                if fd >= 0:
                    os.close(fd)
            if control is not None:
                control.close()
            if held is None:
                held = BwrapKernel(proc, self.cgroup, group=pids_group, init_first=True)
            await finish_even_if_cancelled(held.kill())
            raise
        self.kernel = ForkedKernel(proc, control, output, self.cgroup, pids_group, self.oom_clock)
        self.kernel.holder_output = held.output  # bwrap's, drained until the sandbox ends
        return self.kernel

    async def _start_holder(self, pids_group: Path | None) -> asyncio.subprocess.Process:
        fds: list[int] = []
        holder = HOLDER
        if self.egress is not None:
            holder = with_forwarder(self.programs.kernels.python, holder)
        try:
            # The holder needs nothing of the kernel's environment (the kernel gets it whole).
            argv = self.bwrap_argv({"PATH": "/usr/bin:/bin"}, fds, holder)
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={},
                cwd="/",
                preexec_fn=confine(self.spec.limits, self.cgroup, self.host_uid, pids_group),
                start_new_session=True,
                pass_fds=fds,
            )
        finally:
            for fd in fds:
                os.close(fd)

    def _cgroup_procs(self, pids_group: Path | None) -> list[str]:
        """The cgroup.procs files the kernel joins: the sandbox's, its own pids group in the
        pids hierarchy (as `SandboxCgroup.join_self`)."""
        if self.cgroup is None:
            return []
        pids = self.cgroup.dirs[1]
        return [
            str((pids_group if pids_group is not None and d == pids else d) / "cgroup.procs")
            for d in self.cgroup.dirs
        ]


def _sole_child(bwrap: int) -> int:
    """The sandbox's init: bwrap's one child, pid 1 of the sandbox."""
    with contextlib.suppress(OSError, ValueError):
        children = Path(f"/proc/{bwrap}/task/{bwrap}/children").read_text().split()
        if len(children) == 1:
            return int(children[0])
    raise SandboxStartError("the sandbox's init could not be found")


async def read_pipe(fd: int) -> asyncio.StreamReader:
    """An asyncio reader of the pipe end `fd`, which it takes."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader


class ForkedKernel(BwrapKernel):
    """A kernel the zygote forked into a sandbox bwrap holds open. It is killed as any local
    kernel is (the sandbox's init first, then bwrap: every process in it goes); its end is
    told by its keeper, with its exact status, or is bwrap's, if the sandbox went first."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        control: socket.socket,
        output: asyncio.StreamReader,
        cgroup: SandboxCgroup | None,
        group: Path | None,
        oom_clock: OomClock | None,
    ) -> None:
        super().__init__(proc, cgroup, group, oom_clock, init_first=True, output=output)
        self.control = control
        self.holder_output: StdioTail | None = None

    async def _returncode(self) -> int:
        told = asyncio.ensure_future(hear(self.control, None))
        ended = asyncio.ensure_future(self.proc.wait())
        try:
            await asyncio.wait({told, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            told.cancel()
            ended.cancel()
        if told.done() and not told.cancelled() and told.exception() is None:
            status = told.result().get("status")
            if isinstance(status, int):
                return os.waitstatus_to_exitcode(status)
            # The keeper is gone without a word: its kernel died with it (its parent-death
            # signal), however it ended.
            return -signal.SIGKILL
        return await self.proc.wait()

    async def kill(self) -> None:
        try:
            await super().kill()
        finally:
            self.control.close()
            if self.holder_output is not None:
                self.holder_output.stop()
