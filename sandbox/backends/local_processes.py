"""Processes on the local backend: each joins the running kernel's bubblewrap sandbox.

A process must be inside the very boundary the kernel is in, not a new one beside it: the host
runs util-linux `nsenter` (an absolute path, resolved once) aimed at the sandbox's init (bwrap's
child), which enters its outer user namespace and its mount, PID, IPC, UTS, network and cgroup
namespaces, takes its root and working directory, and runs the sandbox's own interpreter on
`inside_kernel/process_launcher.py`; that finishes the job inside (the kernel's user namespace,
no capabilities, its own session, no_new_privs, the sandbox's seccomp filter) and execs the
command. The host side is confined as the kernel is (`confine` in bwrap_kernel.py: its cgroup,
rlimits, and its host uid when the service runs as root), starts from an empty environment,
and passes only the descriptors it means to. Everything the process needs from the host comes
in memory: the request as JSON and the filter in memfds, a socketpair for the handshake.

With cgroups, each process also gets a pids group of its own inside the sandbox's: signals reach
everything it started, even what left its session; a time limit or close kills them all. Without
them (not root, or cgroups off), signals reach its process group, and whatever escaped that dies
with the sandbox. The sandbox is per kernel: a kernel restart ends its processes.

`unsafe_no_sandbox` has no sandbox to enter: processes are plain host subprocesses in the
workspace, with the kernel's environment and no isolation at all, as the kernel itself is.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import struct
import subprocess
import termios
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import (
    FileAccessError,
    FileMissing,
    ProcessStateError,
    SandboxStartError,
)
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox import seccomp
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.cgroups import ProcessCgroup, SandboxCgroup
from sandbox.host_commands import memfd_with
from sandbox.processes.spawned import SpawnedProcess, Spawner, merged

LAUNCHER_FILE = Path(__file__).parent.parent / "inside_kernel" / "process_launcher.py"
LAUNCHER_IN_SANDBOX = "/opt/code-interpreter/process_launcher.py"
NSENTER_HINT = (
    "util-linux `nsenter` runs processes inside local sandboxes and was not found: install "
    "util-linux (`apt-get install util-linux`)."
)
HANDSHAKE_TIMEOUT_S = 30.0
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace
_CONTROL_LIMIT = 1 << 16  # the most the launcher may say before its exec


@dataclass(frozen=True)
class LocalProcessSettings:
    """What the local backend gives its spawner: how its kernel's sandbox is entered."""

    python: str  # the kernel's interpreter (also inside the sandbox, at the same path)
    nsenter: str | None  # None in unsafe mode: there is no sandbox to enter
    workspace: Path  # on the host; the working directory of unsafe-mode processes
    cgroup: SandboxCgroup | None
    preexec: Callable[[], None]  # the host side of the kernel's own confinement


class LocalSpawner(Spawner):
    def __init__(
        self,
        settings: LocalProcessSettings,
        sandbox_pid: Callable[[], int | None],
        environment: Callable[[dict[str, str]], dict[str, str]],
    ) -> None:
        """`sandbox_pid`: the host pid of the running kernel's bwrap, None while there is none;
        `environment`: the whole environment of a process given the request's variables."""
        self._settings = settings
        self._sandbox_pid = sandbox_pid
        self._environment = environment

    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        s = self._settings
        fds: list[int] = []  # what the child inherits; closed here once it runs
        host_end, child_end = socket.socketpair()
        group = s.cgroup.process_group() if s.cgroup is not None else None
        terminal = os.openpty() if request.terminal is not None else None
        try:
            fds.append(child_end.detach())
            spec: dict[str, object] = {
                "argv": request.full_argv(),
                "env": self._environment(request.env),
                "cwd": request.cwd,
                "terminal": terminal is not None,
                "control_fd": fds[0],
            }
            if s.nsenter is None:
                argv = [s.python, "-I", "-S", str(LAUNCHER_FILE)]
                spec.update(workspace=str(s.workspace), cwd=_unsafe_cwd(request.cwd))
            else:
                init = self._init_pid()
                outer_userns, inner_userns = _namespaces(init, fds)
                fds.append(memfd_with("seccomp", seccomp.bpf_program()))
                spec.update(workspace=WORKSPACE_IN_SANDBOX, userns_fd=inner_userns)
                spec["seccomp_fd"] = fds[-1]
                argv = [
                    s.nsenter, f"--target={init}",
                    f"--user=/proc/self/fd/{outer_userns}", "--preserve-credentials",
                    "--mount", "--pid", "--ipc", "--uts", "--net", "--cgroup",
                    "--root", "--wd", "--",
                    s.python, "-I", "-S", LAUNCHER_IN_SANDBOX,
                ]  # fmt: skip
            fds.append(memfd_with("process", json.dumps(spec).encode()))
            argv.append(str(fds[-1]))
            if terminal is not None:
                stdin = stdout = stderr = terminal[1]
                _set_size(terminal[0], request.terminal or TerminalSize())
            else:
                stdin = subprocess.PIPE if request.stdin else subprocess.DEVNULL
                stdout = stderr = subprocess.PIPE
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env={},
                cwd="/",
                preexec_fn=s.preexec,
                pass_fds=fds,
                limit=1 << 16,
            )
        except BaseException:
            host_end.close()
            if terminal is not None:
                os.close(terminal[0])
            if group is not None:
                group.remove()
            raise
        finally:
            for fd in fds:
                os.close(fd)
            if terminal is not None:
                os.close(terminal[1])
        master = terminal[0] if terminal is not None else None
        nsenter_pid = proc.pid if s.nsenter is not None else None
        try:
            pid, host_pid = await asyncio.to_thread(_handshake, nsenter_pid, host_end, group)
        except BaseException as exc:
            await _abandon(proc, master, group)
            if isinstance(exc, TimeoutError):
                raise SandboxStartError("the process did not start in time") from None
            if isinstance(exc, _NotEntered):
                why = await _stderr(proc)
                raise SandboxStartError(f"the process could not enter the sandbox: {why}") from None
            raise
        finally:
            with contextlib.suppress(OSError):  # wakes a handshake thread left behind
                host_end.shutdown(socket.SHUT_RDWR)
            host_end.close()
        return LocalProcess(proc, pid, host_pid, master, group, s.cgroup)

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


def _namespaces(init: int, fds: list[int]) -> tuple[int, int]:
    """The sandbox's outer user namespace (it owns the others) and the kernel's own, nested
    in it (bwrap's --disable-userns): nsenter enters the first, the launcher the second."""
    pid_ns = os.open(f"/proc/{init}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fds.append(fcntl.ioctl(pid_ns, _NS_GET_USERNS))
    finally:
        os.close(pid_ns)
    fds.append(os.open(f"/proc/{init}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
    return fds[-2], fds[-1]


def _handshake(
    nsenter_pid: int | None, control: socket.socket, group: ProcessCgroup | None
) -> tuple[int, int]:
    """The launcher says its pid in the sandbox, hands over a pipe that its exec closes, and
    waits; its host pid is found (nsenter's child, when it entered a sandbox), put in its
    cgroup, and it is told to go. It then execs (the pipe reads EOF) or says why it could not.
    Returns (pid in the sandbox, host pid). Blocking: run in a thread."""
    control.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        said, fds, _, _ = socket.recv_fds(control, _CONTROL_LIMIT, 1)
    except OSError:
        said, fds = b"", []
    with contextlib.ExitStack() as stack:
        for fd in fds:
            stack.callback(os.close, fd)
        try:
            pid = int(json.loads(said.split(b"\n", 1)[0])["pid"])
            (report,) = fds
        except (ValueError, KeyError, TypeError):
            raise _NotEntered from None
        host_pid = _host_pid(nsenter_pid, pid) if nsenter_pid is not None else pid
        if group is not None:
            group.add(host_pid)
        control.sendall(b"go")
        said = _read_until_closed(report)
    if said:
        try:
            reason = str(json.loads(said.split(b"\n", 1)[0])["error"])
        except (ValueError, KeyError, TypeError):
            reason = "it ended before it ran"
        raise _start_error(reason)
    return pid, host_pid


class _NotEntered(Exception):
    """The launcher never said its pid: nsenter (or the interpreter) failed first."""


def _read_until_closed(fd: int) -> bytes:
    said = b""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    poller = select.poll()  # not select(): the service's descriptors pass 1024 under load
    poller.register(fd, select.POLLIN)
    while len(said) < _CONTROL_LIMIT:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000):
            raise TimeoutError
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        said += chunk
    return said


def _host_pid(nsenter_pid: int, sandbox_pid: int) -> int:
    """nsenter's one child, checked to be `sandbox_pid` in the sandbox."""
    children = Path(f"/proc/{nsenter_pid}/task/{nsenter_pid}/children").read_text().split()
    for child in children:
        for line in Path(f"/proc/{child}/status").read_text().splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == str(sandbox_pid):
                return int(child)
    raise SandboxStartError("the process that entered the sandbox could not be found")


def _start_error(reason: str) -> Exception:
    if "No such file" in reason:
        return FileMissing(f"the process could not start: {reason}")
    if "Permission denied" in reason or "Not a directory" in reason:
        return FileAccessError(f"the process could not start: {reason}")
    return SandboxStartError(f"the process could not start: {reason}")


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    if proc.stderr is None:
        return f"it exited with status {proc.returncode}"
    with contextlib.suppress(Exception):
        text = (await asyncio.wait_for(proc.stderr.read(4096), 5)).decode(errors="replace")
        if text.strip():
            return text.strip()
    return f"it exited with status {proc.returncode}"


async def _abandon(
    proc: asyncio.subprocess.Process, master: int | None, group: ProcessCgroup | None
) -> None:
    """Undo a start that failed half-way: nothing of it may be left running or open."""
    if group is not None:
        await group.kill_all()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
    if master is not None:
        os.close(master)
    if group is not None:
        group.remove()


def _unsafe_cwd(cwd: str | None) -> str | None:
    """With no sandbox, /workspace is the workspace's host directory."""
    if cwd is not None and (
        cwd == WORKSPACE_IN_SANDBOX or cwd.startswith(WORKSPACE_IN_SANDBOX + "/")
    ):
        return cwd[len(WORKSPACE_IN_SANDBOX) :].lstrip("/")
    return cwd


def _set_size(master: int, size: TerminalSize) -> None:
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


class LocalProcess(SpawnedProcess):
    """A process in a local sandbox: its nsenter (or, unsafe, itself) is this service's child;
    the process, `host_pid`, leads its own session and process group."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        pid: int,
        host_pid: int,
        master: int | None,
        group: ProcessCgroup | None,
        sandbox_cgroup: SandboxCgroup | None,
    ) -> None:
        self.pid = pid
        self.host_pid = host_pid
        self._proc = proc
        self._master = master
        # The reader closes `master` at the terminal's end; sizes are set on a copy of it that
        # lives until wait(), so a number reused meanwhile is never touched.
        self._sizer = os.dup(master) if master is not None else None
        self._group = group
        self._sandbox_cgroup = sandbox_cgroup
        self._oom_kills = sandbox_cgroup.oom_kills() if sandbox_cgroup is not None else 0
        self._terminal_writer: asyncio.StreamWriter | None = None
        self._terminal_opened: asyncio.Future[asyncio.StreamReader] | None = None
        self._end: ProcessEnd | None = None

    async def output(self) -> AsyncIterator[tuple[Stream, bytes]]:
        readers: dict[Stream, asyncio.StreamReader]
        if self._master is not None:
            readers = {"pty": await self._terminal()}
        else:
            assert self._proc.stdout is not None and self._proc.stderr is not None
            readers = {"stdout": self._proc.stdout, "stderr": self._proc.stderr}
        async for item in merged(readers):
            yield item

    async def _terminal(self) -> asyncio.StreamReader:
        """The terminal's master, read and written through the event loop (never blocking it).
        Opened once: output() and write_stdin() may both ask at the same time."""
        if self._terminal_opened is None:
            self._terminal_opened = asyncio.ensure_future(self._open_terminal())
        return await asyncio.shield(self._terminal_opened)

    async def _open_terminal(self) -> asyncio.StreamReader:
        assert self._master is not None
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 16)
        master = os.fdopen(self._master, "rb", buffering=0)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), master)
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
            os.fdopen(os.dup(self._master), "wb", buffering=0),
        )
        self._terminal_writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return reader

    async def write_stdin(self, data: bytes) -> None:
        if self._master is not None:
            await self._terminal()
            assert self._terminal_writer is not None
            if self._terminal_writer.is_closing():
                raise ProcessStateError(f"process {self.pid} has ended: its terminal is gone")
            self._terminal_writer.write(data)
            await self._terminal_writer.drain()
            return
        stdin = self._stdin()
        try:
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise ProcessStateError(
                f"process {self.pid} no longer reads its input (it closed it or ended)"
            ) from None

    async def close_stdin(self) -> None:
        if self._master is not None:  # a terminal's end of input: ^D at the start of a line
            await self.write_stdin(b"\x04")
            return
        stdin = self._stdin()
        if not stdin.is_closing():
            stdin.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await stdin.wait_closed()

    def _stdin(self) -> asyncio.StreamWriter:
        if self._proc.stdin is None:
            raise ProcessStateError(
                f"process {self.pid} was started without input: start it with stdin set to "
                "send it any"
            )
        return self._proc.stdin

    async def signal(self, signum: int) -> None:
        if self._proc.returncode is not None and self._group is None:
            return  # reaped: its group's number may be another process's by now
        if self._group is not None:
            await asyncio.to_thread(self._group.signal, signum)
            if signum == signal.SIGKILL:
                await self._group.kill_all()
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.host_pid, signum)
        if signum not in (signal.SIGSTOP, signal.SIGTSTP) and self._proc.returncode is None:
            # nsenter stops itself when its child stops (it mirrors the child's state) and,
            # stopped, never reaps it: wake it after anything but a stop.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self._proc.pid, signal.SIGCONT)

    async def resize(self, size: TerminalSize) -> None:
        if self._master is None:
            raise ProcessStateError(f"process {self.pid} has no terminal to resize")
        if self._sizer is None:
            raise ProcessStateError(f"process {self.pid} has ended: its terminal is gone")
        _set_size(self._sizer, size)

    async def wait(self) -> ProcessEnd:
        if self._end is None:
            code = await self._proc.wait()
            if self._terminal_writer is not None:
                self._terminal_writer.close()
            if self._sizer is not None:
                os.close(self._sizer)
                self._sizer = None
            if self._group is not None:
                self._group.remove()  # when nothing it started still runs; else with the sandbox
            self._end = self._ending(code)
        return self._end

    def _ending(self, code: int) -> ProcessEnd:
        if code >= 0:
            return ProcessEnd(
                exit_code=code, error=None if code == 0 else f"it exited with status {code}"
            )
        signum = -code
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        error = f"it was ended by {name}"
        cgroup = self._sandbox_cgroup
        if signum == signal.SIGKILL and cgroup is not None and cgroup.oom_kills() > self._oom_kills:
            error = "it was killed for lack of memory: the sandbox ran out of its memory limit"
        return ProcessEnd(exit_code=None, signal=signum, error=error)
