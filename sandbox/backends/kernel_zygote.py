"""The service's end of the kernel zygote (sandbox/inside_kernel/kernel_zygote.py): one per
backend with `zygote_modules` (for Docker, one per image: docker_zygote.py), started at its
first kernel, started again if it dies.

A kernel is forked into a sandbox held open (by bwrap: `BwrapLauncher`; by a container:
`ForkingContainerLauncher`): the sandbox's namespaces, root, cgroups and seccomp filter go to
the zygote as descriptors, with a pipe for the kernel's output and a socket on which its keeper
says the kernel's pid and, later, how it ended (`ForkedKernel`, `ForkedContainerKernel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from code_interpreter_wire.errors import SandboxStartError
from sandbox import seccomp
from sandbox.backends.local_command_server import user_namespaces
from sandbox.host_commands import memfd_with
from sandbox.inside_kernel import kernel_zygote

log = logging.getLogger(__name__)
T = TypeVar("T")

ZYGOTE_FILE = Path(kernel_zygote.__file__)
START_TIMEOUT_S = 120.0  # its imports: pandas and matplotlib take seconds on a busy host
FORK_TIMEOUT_S = 30.0
RETRY_AFTER_S = 60.0  # a zygote that failed to start is not tried again sooner


# Variables read only as a program starts (Python's own, the loader's and libc's, the locale)
# or as a module the zygote imported loads (matplotlib's, the maths libraries' threads, the
# allocator pyarrow brings): a session that sets one gets a kernel started afresh, which reads
# them. PYTHONPATH is not one: a forked kernel applies it itself.
STARTUP_ONLY = (
    "PYTHON", "LD_", "GLIBC_", "MALLOC_", "JE_", "LANG", "LC_", "MPL", "OMP_", "MKL_", "OPENBLAS_",
    "TZ", "TMPDIR",  # the time zone libc and `time` read once; tempfile's directory, cached
)  # fmt: skip


def read_only_at_startup(env: Mapping[str, str]) -> bool:
    """Whether a session's variables hold one a forked kernel would not apply (STARTUP_ONLY)."""
    return any(n.startswith(STARTUP_ONLY) and n != "PYTHONPATH" for n in env)


async def forked_or_afresh(
    fork: Callable[[], Awaitable[T]], afresh: Callable[[], Awaitable[T]]
) -> T:
    """A kernel forked by `fork`, or started by `afresh` where the zygote failed: slower,
    never worse."""
    try:
        return await fork()
    except ZygoteFailed as exc:
        log.warning("a kernel is started afresh: %s", exc)
        return await afresh()


# What a zygote's imports read so as to start no thread (a process with threads cannot be
# forked safely): one thread for every maths library (they start theirs at import; a kernel
# takes back its own number: kernel_zygote.py), no background thread for the allocator of
# pyarrow (which pandas imports where it is installed).
SINGLE_THREADED = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}


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

    init: int  # the host pid of the sandbox's init (bwrap's child, a container's first)
    uid: int  # the sandbox's host uid
    argv: list[str]  # ipykernel's command line, after `-m ipykernel_launcher`
    env: dict[str, str]
    workdir: str
    cgroup_procs: list[str]  # the cgroup.procs files the kernel joins
    rlimits: list[tuple[int, int]]
    # Whether the sandbox has user namespaces of its own (bwrap's: outer and the kernel's);
    # a container has none.
    user_namespaces: bool = True
    groups: tuple[int, ...] = ()  # its supplementary groups (a container's runtime gives some)
    # A pidfd of `init`, where its pid is not this service's child's and so could be reused:
    # the sandbox's descriptors count only if it still runs once they are open.
    init_pidfd: int | None = None


class Zygote:
    """What every zygote's service end does: start it (`_spawn`, its own), fork through it,
    start it again once it is gone, stop it (`_kill`, its own)."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        self._connection: socket.socket | None = None
        self._lock = asyncio.Lock()
        self._generation = 0  # of the zygote started last: a fork that fails stops only its own
        self.failed_imports: dict[str, str] = {}
        self._failed_at: float | None = None  # when it last failed to start
        self._failure = ""

    async def fork(self, request: ForkRequest, output: int) -> tuple[socket.socket, int]:
        """Fork a kernel as `request` says, its output written to `output` (a pipe's end);
        the control socket on which its keeper says how it ended (`ForkedKernel`), and the
        kernel's host pid."""
        named: list[tuple[str, int]] = []
        control, keeper_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            named += _namespaces(request.init, request.user_namespaces)
            named += _cgroups(request.cgroup_procs)
            if request.init_pidfd is not None and _ended(request.init_pidfd):
                raise ZygoteFailed("the sandbox to fork into ended as its kernel was forked")
            named.append(("seccomp", memfd_with("seccomp", seccomp.bpf_program())))
            named.append(("output", os.dup(output)))
            named.append(("control", keeper_end.detach()))
            # In memory, read by the keeper only: the zygote never holds a session's variables,
            # and no environment is too large for a message.
            message = json.dumps(_message(request)).encode()
            named.append(("request", memfd_with("kernel", message)))
            names = json.dumps({"fork": [name for name, _ in named]}).encode()
            async with self._lock:
                connection = await self._started()
                zygote = self._generation
                try:
                    socket.send_fds(connection, [names], [fd for _, fd in named])
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
            for _, fd in named:
                os.close(fd)
        try:
            try:
                said = await hear(control, FORK_TIMEOUT_S)
            except ZygoteFailed:
                said = {}
            if not said:  # no keeper: the zygote could not fork, or is stuck
                async with self._lock:
                    if self._generation == zygote:  # not one started since by another fork
                        await self._stop()
                raise ZygoteFailed("the kernel zygote did not fork; it is started again")
            if "keeper" in said:
                said = await hear(control, FORK_TIMEOUT_S)
            kernel = said.get("kernel")
            if not isinstance(kernel, int) or kernel <= 0:
                raise ZygoteFailed(f"the kernel could not be forked: {said.get('error', said)}")
        except BaseException:
            control.close()
            raise
        return control, kernel

    async def _started(self) -> socket.socket:
        """The connection to a running zygote, started now if there is none (the lock held).
        One that failed to start is not tried again for a while: kernels start afresh."""
        if self._connection is not None and self._running():
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
        self._generation += 1
        try:
            connection = await self._spawn()
        except BaseException as exc:
            await self._stop()
            if isinstance(exc, OSError):
                raise ZygoteFailed(f"the kernel zygote could not be started: {exc}") from None
            raise
        connection.setblocking(False)
        self._connection = connection
        try:
            connection.send(json.dumps({"modules": zygote_imports(self.modules)}).encode())
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
        await self._kill()

    async def close(self) -> None:
        """Stop the zygote; the kernels forked from it live on (each has its keeper)."""
        async with self._lock:
            await self._stop()

    async def _spawn(self) -> socket.socket:
        """Start the zygote: the service's end of its connection, the modules not yet sent."""
        raise NotImplementedError

    async def _kill(self) -> None:
        """Stop the zygote, if it runs; its connection is closed already."""
        raise NotImplementedError

    def _running(self) -> bool:
        """Whether the zygote started last runs still."""
        raise NotImplementedError


class KernelZygote(Zygote):
    """A local backend's zygote: a process of the host's, beside the service."""

    def __init__(self, python: str, modules: list[str], env: dict[str, str], home: Path) -> None:
        super().__init__(modules)
        self.python = python
        self.home = home  # its own, removed with it
        self.env = env
        self._proc: asyncio.subprocess.Process | None = None

    async def _spawn(self) -> socket.socket:
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
        return connection

    def _running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(shutil.rmtree, self.home, True)


def _message(request: ForkRequest) -> dict[str, Any]:
    return {
        "uid": request.uid,
        "groups": list(request.groups),
        "argv": request.argv,
        "env": request.env,
        "workdir": request.workdir,
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


def _namespaces(init: int, users: bool) -> list[tuple[str, int]]:
    """The descriptors a fork request carries, opened from the sandbox's init: with `users`,
    its outer user namespace (which owns the others) and the kernel's own (nested in it:
    bwrap's --disable-userns); its mount, PID, IPC, UTS, network and cgroup namespaces, and
    its root."""
    fds: list[int] = []
    names: list[str] = []
    try:
        if users:
            user_namespaces(init, fds)
            names += ["outer_userns", "inner_userns"]
        for name, _ in kernel_zygote.NAMESPACES:
            fds.append(os.open(f"/proc/{init}/ns/{name}", os.O_RDONLY | os.O_CLOEXEC))
            names.append(name)
        fds.append(os.open(f"/proc/{init}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        names.append("root")
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise ZygoteFailed(f"the sandbox to fork into is gone: {exc}") from None
    return list(zip(names, fds, strict=True))


def _ended(pidfd: int) -> bool:
    """Whether the process of `pidfd` has ended (its pidfd reads as ready)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _cgroups(procs: list[str]) -> list[tuple[str, int]]:
    """The cgroup.procs files the kernel joins, opened for writing here: the keeper writes
    to them, where it cannot see them (a zygote in a container)."""
    most = kernel_zygote.MAX_CGROUPS
    if len(procs) > most:
        raise ZygoteFailed(f"a sandbox in {len(procs)} cgroups: at most {most} can be joined")
    fds: list[int] = []
    try:
        for path in procs:
            fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise ZygoteFailed(f"the sandbox's cgroup cannot be joined: {exc}") from None
    return [(kernel_zygote.CGROUP_PROCS, fd) for fd in fds]
