"""Processes on the local backend: each joins the running kernel's bubblewrap sandbox.

A process must be inside the very boundary the kernel is in, not a new one beside it: the
sandbox's command server (`local_command_server.py`), entered and confined once, forks each
one there. The host makes its pipes (or terminal) and a control socket, and hands them over
with the request; the process says its pid, waits while the host puts it in its cgroup, and
execs. Its end comes from the server, which reaps it.

With cgroups, each process also gets a pids group of its own inside the sandbox's: signals reach
everything it started, even what left its session; a time limit or close kills them all. Without
them (not root, or cgroups off), signals reach its process group, and whatever escaped that dies
with the sandbox. The sandbox is per kernel: a kernel restart ends its processes.

`unsafe_no_sandbox` has no sandbox to enter: processes are plain host processes in the
workspace, with the kernel's environment and no isolation at all, as the kernel itself is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from pathlib import Path

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.backends.local_command_server import LocalProcessSettings, start_local_server
from sandbox.cgroups import ProcessCgroup, SandboxCgroup
from sandbox.processes.command_server import CommandServer, child_with_pid
from sandbox.processes.served import SANDBOX_END_S, ServedProcess, ServedSpawner, Started, exit_of
from sandbox.processes.spawned import SpawnedProcess

NSENTER_HINT = (
    "util-linux `nsenter` runs processes inside local sandboxes and was not found: install "
    "util-linux (`apt-get install util-linux`)."
)


class LocalSpawner(ServedSpawner):
    def __init__(
        self,
        settings: LocalProcessSettings,
        sandbox_pid: Callable[[], int | None],
        environment: Callable[[dict[str, str]], dict[str, str]],
    ) -> None:
        """`sandbox_pid`: the host pid of the running kernel's bwrap, None while there is none;
        `environment`: the whole environment of a process given the request's variables."""
        super().__init__()
        self._settings = settings
        self._sandbox_pid = sandbox_pid
        self._environment = environment

    def _current_sandbox(self) -> int | None:
        return self._init_pid() if self._settings.nsenter is not None else None

    async def _start_server(self, sandbox: int | str | None) -> CommandServer:
        assert not isinstance(sandbox, str)
        return await start_local_server(self._settings, sandbox)

    def _command(self, request: ProcessRequest) -> tuple[dict[str, object], str | None]:
        unsafe = self._settings.nsenter is None
        spec: dict[str, object] = {
            "argv": request.full_argv(),
            "env": self._environment(request.env),
            "cwd": _unsafe_cwd(request.cwd) if unsafe else request.cwd,
        }
        return spec, None

    def _new_group(self) -> ProcessCgroup | None:
        cgroup = self._settings.cgroup
        return cgroup.process_group() if cgroup is not None else None

    def _place(self, server: CommandServer, pid: int, group: ProcessCgroup | None) -> int:
        """Its host pid (a child of the server's), put in its cgroup."""
        assert server.host_pid is not None
        host_pid = child_with_pid(server.host_pid, pid)
        if group is not None:
            group.add(host_pid)
        return host_pid

    def _process(self, started: Started) -> SpawnedProcess:
        return LocalProcess(started, self._settings.cgroup)

    def _init_pid(self) -> int:
        """The sandbox's init: bwrap's one child, pid 1 of the sandbox."""
        bwrap = self._sandbox_pid()
        if bwrap is not None:
            with contextlib.suppress(OSError, ValueError):
                children = Path(f"/proc/{bwrap}/task/{bwrap}/children").read_text().split()
                if len(children) == 1:
                    return int(children[0])
        raise SandboxStartError(
            "the sandbox's kernel is not running (it is starting, restarting or has ended); "
            "try again in a moment"
        )


def _unsafe_cwd(cwd: str | None) -> str | None:
    """With no sandbox, /workspace is the workspace's host directory."""
    if cwd is not None and (
        cwd == WORKSPACE_IN_SANDBOX or cwd.startswith(WORKSPACE_IN_SANDBOX + "/")
    ):
        return cwd[len(WORKSPACE_IN_SANDBOX) :].lstrip("/")
    return cwd


class LocalProcess(ServedProcess):
    """Signalled from the host: through its cgroup (everything it started), or without one its
    process group; a SIGKILL the sandbox's OOM killer sent is told as such."""

    def __init__(self, started: Started, sandbox_cgroup: SandboxCgroup | None) -> None:
        super().__init__(started)
        assert started.host_pid is not None
        self.host_pid = started.host_pid
        self._sandbox_cgroup = sandbox_cgroup
        self._oom_kills = sandbox_cgroup.oom_kills() if sandbox_cgroup is not None else 0

    async def signal(self, signum: int) -> None:
        group = self.started.group
        if group is not None:
            await asyncio.to_thread(group.signal, signum)
            if signum == signal.SIGKILL:
                await group.kill_all()
        elif not self.reaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.host_pid, signum)

    async def _unseen(self) -> ProcessEnd:
        init = self.started.server.serves
        if isinstance(init, int) and await _ends_soon(init):
            return ProcessEnd(
                exit_code=None,
                signal=signal.SIGKILL,
                error="killed with its sandbox: its kernel was replaced or the sandbox closed",
            )
        return await super()._unseen()

    def _ending(self, code: int) -> ProcessEnd:
        end = super()._ending(code)
        cgroup = self._sandbox_cgroup
        killed = end.signal == signal.SIGKILL and cgroup is not None
        if killed and cgroup is not None and cgroup.oom_kills() > self._oom_kills:
            error = "it was killed for lack of memory: the sandbox ran out of its memory limit"
            return end.model_copy(update={"error": error})
        return end


async def _ends_soon(init: int) -> bool:
    """Whether the sandbox whose init is `init` has ended, or does within SANDBOX_END_S."""
    try:
        pidfd = os.pidfd_open(init)
    except OSError:
        return True  # gone already
    try:
        await asyncio.wait_for(exit_of(pidfd), SANDBOX_END_S)
    except TimeoutError:
        return False
    finally:
        os.close(pidfd)
    return True
