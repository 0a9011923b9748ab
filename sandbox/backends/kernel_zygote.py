"""The service's end of the kernel zygote (sandbox/inside_kernel/kernel_zygote.py): one per
local backend with `zygote_modules`, started at its first kernel, started again if it dies.

A kernel is forked into a sandbox bwrap holds open (`BwrapLauncher`): the sandbox's namespaces,
root and seccomp filter go to the zygote as descriptors, with a pipe for the kernel's output and
a socket on which its keeper says the kernel's pid and, later, how it ended (`ForkedKernel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from code_interpreter_wire.errors import SandboxStartError
from sandbox import seccomp
from sandbox.backends.local_command_server import user_namespaces
from sandbox.host_commands import memfd_with
from sandbox.inside_kernel import kernel_zygote

log = logging.getLogger(__name__)

ZYGOTE_FILE = Path(kernel_zygote.__file__)
START_TIMEOUT_S = 120.0  # its imports: pandas and matplotlib take seconds on a busy host
FORK_TIMEOUT_S = 30.0
RETRY_AFTER_S = 60.0  # a zygote that failed to start is not tried again sooner


# Imported by every zygote, beside the operator's modules: the kernel's own stack, which each
# kernel would otherwise import for itself (~270 modules).
KERNEL_MODULES = ("ipykernel.kernelapp", "ipykernel.ipkernel", "ipykernel.zmqshell", "IPython")
# With matplotlib: what a kernel's first chart imports (its inline backend, which the
# kernel's start-up file hooks into the kernel's shell; the chart extractor of
# display_forms.py; PIL for the image).
CHART_MODULES = ("matplotlib_inline.backend_inline", "e2b_charts", "PIL.Image")


# With pandas and matplotlib: pandas' plotting, which its first `.plot()` imports (~7 MiB a
# kernel, measured).
PANDAS_CHART_MODULES = ("pandas.plotting._matplotlib",)


def zygote_imports(modules: list[str]) -> list[str]:
    """What a zygote for `modules` imports, in order: the kernel's stack, then theirs."""
    tops = {m.split(".")[0] for m in modules}
    charts: tuple[str, ...] = CHART_MODULES if "matplotlib" in tops else ()
    if {"matplotlib", "pandas"} <= tops:
        charts += PANDAS_CHART_MODULES
    return list(dict.fromkeys([*KERNEL_MODULES, *modules, *charts]))


class ZygoteFailed(SandboxStartError):
    """The zygote could not start, or could not fork a kernel; the message says why."""


@dataclass(frozen=True)
class ForkRequest:
    """What a kernel forked into a sandbox is: see kernel_zygote.py."""

    init: int  # the host pid of the sandbox's init (bwrap's child)
    uid: int  # the sandbox's host uid
    argv: list[str]  # ipykernel's command line, after `-m ipykernel_launcher`
    env: dict[str, str]
    workdir: str
    cgroup_procs: list[str]  # the cgroup.procs files the kernel joins
    rlimits: list[tuple[int, int]]


class KernelZygote:
    def __init__(self, python: str, modules: list[str], env: dict[str, str], home: Path) -> None:
        self.python = python
        self.home = home  # its own, removed with it
        self.modules = modules
        self.env = env
        self._proc: asyncio.subprocess.Process | None = None
        self._connection: socket.socket | None = None
        self._lock = asyncio.Lock()
        self.failed_imports: dict[str, str] = {}
        self._failed_at: float | None = None  # when it last failed to start
        self._failure = ""

    async def fork(self, request: ForkRequest, output: int) -> socket.socket:
        """Fork a kernel as `request` says, its output written to `output` (a pipe's end);
        the control socket on which its keeper says how it ended (`ForkedKernel`)."""
        fds: list[int] = []
        control, keeper_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fds += _namespaces(request.init)
            fds.append(memfd_with("seccomp", seccomp.bpf_program()))
            fds.append(os.dup(output))
            fds.append(keeper_end.detach())
            # In memory, read by the keeper only: the zygote never holds a session's variables,
            # and no environment is too large for a message.
            fds.append(memfd_with("kernel", json.dumps(_message(request)).encode()))
            async with self._lock:
                connection = await self._started()
                zygote = self._proc
                try:
                    socket.send_fds(connection, [b"fork"], fds)
                except BlockingIOError:  # alive, its queue full: this kernel starts afresh
                    raise ZygoteFailed("the kernel zygote is busy") from None
                except OSError as exc:  # it died since: the next fork starts another
                    await self._stop()
                    raise ZygoteFailed(f"the kernel zygote is gone: {exc}") from None
        except BaseException:
            keeper_end.close()  # if not yet handed over
            control.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        try:
            try:
                said = await hear(control, FORK_TIMEOUT_S)
            except ZygoteFailed:
                said = {}
            if not said:  # no keeper: the zygote could not fork, or is stuck
                async with self._lock:
                    if self._proc is zygote:  # not one started since by another fork
                        await self._stop()
                raise ZygoteFailed("the kernel zygote did not fork; it is started again")
            if "keeper" in said:
                said = await hear(control, FORK_TIMEOUT_S)
            if "kernel" not in said:
                raise ZygoteFailed(f"the kernel could not be forked: {said.get('error', said)}")
        except BaseException:
            control.close()
            raise
        return control

    async def _started(self) -> socket.socket:
        """The connection to a running zygote, started now if there is none (the lock held).
        One that failed to start is not tried again for a while: kernels start afresh."""
        if self._proc is not None and self._proc.returncode is None and self._connection:
            return self._connection
        await self._stop()
        if self._failed_at is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S:
            raise ZygoteFailed(f"the kernel zygote failed to start: {self._failure}")
        try:
            return await self._start()
        except ZygoteFailed as exc:
            self._failed_at, self._failure = time.monotonic(), str(exc)
            raise

    async def _start(self) -> socket.socket:
        connection, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.python,
                str(ZYGOTE_FILE),
                str(zygote_end.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=self.env,
                cwd="/",
                pass_fds=[zygote_end.fileno()],
                start_new_session=True,
            )
        except BaseException:
            connection.close()
            raise
        finally:
            zygote_end.close()
        connection.setblocking(False)
        self._connection = connection
        connection.send(json.dumps({"modules": zygote_imports(self.modules)}).encode())
        try:
            said = await hear(connection, START_TIMEOUT_S)
        except BaseException:
            await self._stop()
            raise
        if "ready" not in said:
            await self._stop()
            raise ZygoteFailed(f"the kernel zygote did not start: {said.get('error', said)}")
        self.failed_imports = said.get("failed") or {}
        for name, why in self.failed_imports.items():  # ours are optional: the operator's not
            level = logging.WARNING if name in self.modules else logging.DEBUG
            log.log(level, "the kernel zygote could not import %s: %s", name, why)
        return connection

    async def _stop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        """Stop the zygote; the kernels forked from it live on (each has its keeper)."""
        async with self._lock:
            await self._stop()
        await asyncio.to_thread(shutil.rmtree, self.home, True)


def _message(request: ForkRequest) -> dict[str, Any]:
    return {
        "uid": request.uid,
        "argv": request.argv,
        "env": request.env,
        "workdir": request.workdir,
        "cgroup_procs": request.cgroup_procs,
        "rlimits": request.rlimits,
    }


async def hear(channel: socket.socket, timeout_s: float | None) -> dict[str, Any]:
    """One message on a non-blocking SOCK_SEQPACKET socket; {} once its peer is gone."""
    channel.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        data = await asyncio.wait_for(loop.sock_recv(channel, 1 << 16), timeout_s)
    except TimeoutError:
        raise ZygoteFailed("the kernel zygote did not answer in time") from None
    if not data:
        return {}
    try:
        said = json.loads(data)
    except ValueError:
        return {"error": "an unreadable answer"}
    return said if isinstance(said, dict) else {"error": "an unreadable answer"}


def _namespaces(init: int) -> list[int]:
    """The descriptors a fork request carries, opened from the sandbox's init: its outer user
    namespace (which owns the others), the kernel's own (nested in it: bwrap's
    --disable-userns), its mount, PID, IPC, UTS, network and cgroup namespaces, and its root."""
    fds: list[int] = []
    try:
        user_namespaces(init, fds)
        for name, _ in kernel_zygote.NAMESPACES:
            fds.append(os.open(f"/proc/{init}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
        fds.append(os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise ZygoteFailed(f"the sandbox to fork into is gone: {exc}") from None
    return fds
