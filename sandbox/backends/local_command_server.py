"""The host's end of a local sandbox's command server (`inside_kernel/command_server.py`).

One server per sandbox (per kernel: a restart makes a new sandbox, and a new server there),
started at the sandbox's first command: util-linux `nsenter` (an absolute path, resolved once),
aimed at the sandbox's init (bwrap's child), enters its outer user namespace and its mount, PID,
IPC, UTS, network and cgroup namespaces, takes its root and working directory, and runs the
sandbox's own interpreter on the server, which confines itself as the kernel is and then forks
every command. The host side is confined as the kernel is (`confine` in bwrap_kernel.py: its
cgroup, rlimits, and its host uid when the service runs as root), starts from an empty
environment, and passes only the descriptors it means to; what the server needs comes in
memory (its settings as JSON and the seccomp filter in memfds) and over one socketpair.

`unsafe_no_sandbox` has no sandbox to enter: the server is a plain host process in the
workspace, and so are its commands.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import SandboxStartError
from sandbox import seccomp
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.cgroups import SandboxCgroup
from sandbox.host_commands import memfd_with
from sandbox.kernel.programs import COMMAND_SERVER_FILE, COMMAND_SERVER_IN_SANDBOX
from sandbox.processes.command_server import MESSAGE_LIMIT, CommandServer, child_with_pid

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace


@dataclass(frozen=True)
class LocalProcessSettings:
    """What the local backend gives its spawner: how its kernel's sandbox is entered."""

    python: str  # the kernel's interpreter (also inside the sandbox, at the same path)
    nsenter: str | None  # None in unsafe mode: there is no sandbox to enter
    workspace: Path  # on the host; the working directory of unsafe-mode processes
    cgroup: SandboxCgroup | None
    preexec: Callable[[], None]  # the host side of the kernel's own confinement


async def start_local_server(settings: LocalProcessSettings, init: int | None) -> CommandServer:
    """Start one in the sandbox whose init is `init` (None: unsafe, no sandbox)."""
    connection, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [server_end.detach()]
    try:
        spec: dict[str, object] = {"connection_fd": fds[0]}
        if settings.nsenter is None or init is None:
            argv = [settings.python, "-I", "-S", str(COMMAND_SERVER_FILE)]
            spec["workspace"] = str(settings.workspace)
        else:
            outer_userns, inner_userns = user_namespaces(init, fds)
            fds.append(memfd_with("seccomp", seccomp.bpf_program()))
            spec.update(workspace=WORKSPACE_IN_SANDBOX, userns_fd=inner_userns)
            spec["seccomp_fd"] = fds[-1]
            argv = [
                settings.nsenter, f"--target={init}",
                f"--user=/proc/self/fd/{outer_userns}", "--preserve-credentials",
                "--mount", "--pid", "--ipc", "--uts", "--net", "--cgroup",
                "--root", "--wd", "--",
                settings.python, "-I", "-S", COMMAND_SERVER_IN_SANDBOX,
            ]  # fmt: skip
        fds.append(memfd_with("command-server", json.dumps(spec).encode()))
        argv.append(str(fds[-1]))
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={},
            cwd="/",
            preexec_fn=settings.preexec,
            pass_fds=fds,
            limit=1 << 16,
        )
    except BaseException:
        connection.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    connection.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        hearing = loop.sock_recv(connection, MESSAGE_LIMIT)
        said = await asyncio.wait_for(hearing, START_TIMEOUT_S)
        hello = json.loads(said) if said else {}
        if "pid" not in hello:
            why = str(hello.get("error") or await _stderr(proc))
            raise SandboxStartError(f"the process could not enter the sandbox: {why}")
        inside = int(hello["pid"])
        host_pid = proc.pid if init is None else child_with_pid(proc.pid, inside)
    except BaseException as exc:
        connection.close()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        if isinstance(exc, TimeoutError):
            raise SandboxStartError("the process did not start in time") from None
        if isinstance(exc, ValueError | TypeError):
            raise SandboxStartError("the sandbox's command server said nonsense") from None
        raise
    return CommandServer(connection, serves=init, host_pid=host_pid, proc=proc)


def user_namespaces(init: int, fds: list[int]) -> tuple[int, int]:
    """The sandbox's outer user namespace (it owns the others) and the kernel's own, nested
    in it (bwrap's --disable-userns), opened into `fds`: nsenter enters the first, the server
    the second (a forked kernel's keeper and the kernel likewise: kernel_zygote.py)."""
    pid_ns = os.open(f"/proc/{init}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fds.append(fcntl.ioctl(pid_ns, _NS_GET_USERNS))
    finally:
        os.close(pid_ns)
    fds.append(os.open(f"/proc/{init}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
    return fds[-2], fds[-1]


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    if proc.stderr is None:
        return "it ended before it ran"
    with contextlib.suppress(Exception):
        text = (await asyncio.wait_for(proc.stderr.read(4096), 5)).decode(errors="replace")
        if text.strip():
            return text.strip()
    return "it ended before it ran"
