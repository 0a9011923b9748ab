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
import fcntl
import functools
import json
import os
import select
import signal
import socket
import struct
import termios
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from code_interpreter_wire.errors import (
    FileAccessError,
    FileMissing,
    ProcessStateError,
    SandboxStartError,
)
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.backends.local_command_server import (
    CommandFds,
    CommandServer,
    ServerGone,
    child_with_pid,
)
from sandbox.cgroups import ProcessCgroup, SandboxCgroup
from sandbox.processes.spawned import SpawnedProcess, Spawner, merged

NSENTER_HINT = (
    "util-linux `nsenter` runs processes inside local sandboxes and was not found: install "
    "util-linux (`apt-get install util-linux`)."
)
HANDSHAKE_TIMEOUT_S = 30.0
_CONTROL_LIMIT = 1 << 16  # the most a process may say before its exec


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
        self._server: CommandServer | None = None
        self._server_lock = asyncio.Lock()
        self._closed = False

    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        s = self._settings
        server = await self._running_server()
        host_end, child_end = socket.socketpair()
        theirs: list[int] = [child_end.detach()]  # sent to the server, then closed here
        ours: list[int] = []  # kept: the host's ends of the process's pipes
        master: int | None = None  # kept: a terminal's
        group: ProcessCgroup | None = None
        pipes: _Pipes | None = None
        command, end = server.expect()
        try:
            group = s.cgroup.process_group() if s.cgroup is not None else None
            if request.terminal is not None:
                master, slave = os.openpty()
                theirs.append(slave)
                fds = CommandFds(slave, slave, slave, theirs[0])
                _set_size(master, request.terminal)
            else:
                stdin_writer = None
                if request.stdin:
                    stdin, stdin_writer = os.pipe()
                    ours.append(stdin_writer)
                else:
                    stdin = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                theirs.append(stdin)
                stdout_reader, stdout = os.pipe()
                ours.append(stdout_reader)
                theirs.append(stdout)
                stderr_reader, stderr = os.pipe()
                ours.append(stderr_reader)
                theirs.append(stderr)
                fds = CommandFds(stdin, stdout, stderr, theirs[0])
                pipes = _Pipes(stdin_writer, stdout_reader, stderr_reader)
            cwd = request.cwd if s.nsenter is not None else _unsafe_cwd(request.cwd)
            spec: dict[str, object] = {
                "argv": request.full_argv(),
                "env": self._environment(request.env),
                "cwd": cwd,
                "terminal": master is not None,
            }
            try:
                await server.send(command, spec, fds)
            except ServerGone:  # killed or stopped from inside the sandbox: again, with a new one
                server.forget(command)
                server = await self._running_server(replacing=server)
                command, end = server.expect()
                await server.send(command, spec, fds)
        except BaseException:
            server.forget(command)
            host_end.close()
            for fd in ours:
                os.close(fd)
            await _abandon(master, group)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        try:
            pid, host_pid = await asyncio.to_thread(_handshake, server.host_pid, host_end, group)
        except BaseException as exc:
            with contextlib.suppress(OSError):  # wakes the handshake's thread, if it still runs
                host_end.shutdown(socket.SHUT_RDWR)
            await server.kill(command)
            server.forget(command)
            for fd in ours:
                os.close(fd)
            await _abandon(master, group)
            if isinstance(exc, _ServerSilent):
                server.wedged()
            if isinstance(exc, TimeoutError):
                raise SandboxStartError("the process did not start in time") from None
            if isinstance(exc, _NotEntered):
                raise SandboxStartError(
                    "the process could not enter the sandbox: its command server ended (the "
                    "kernel is restarting or the sandbox is closing); try again in a moment"
                ) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                host_end.shutdown(socket.SHUT_RDWR)
            host_end.close()
        return LocalProcess(end, pid, host_pid, master, pipes, group, s.cgroup)

    async def _running_server(self, replacing: CommandServer | None = None) -> CommandServer:
        """The server of the sandbox as it is now: started at its first command, and again
        after a kernel restart (which ends the old one with its sandbox) or once it is found
        gone (`replacing` it)."""
        if self._closed:
            raise SandboxStartError("the sandbox is closed")
        async with self._server_lock:
            init = self._init_pid() if self._settings.nsenter is not None else None
            current = self._server
            fresh = current is not None and current is not replacing and current.alive
            if current is not None and fresh and current.init == init:
                return current
            if current is not None:
                await current.close()
            self._server = await CommandServer.start(self._settings, init)
            return self._server

    async def close(self) -> None:
        self._closed = True
        async with self._server_lock:
            if self._server is not None:
                await self._server.close()

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


@dataclass(frozen=True)
class _Pipes:
    """The host's ends of a process's pipes (stdin's None when it reads /dev/null)."""

    stdin: int | None
    stdout: int
    stderr: int


def _handshake(
    server_pid: int, control: socket.socket, group: ProcessCgroup | None
) -> tuple[int, int]:
    """The process says its pid in the sandbox, hands over a pipe that its exec closes, and
    waits; its host pid is found (a child of the server's), put in its cgroup, and it is told to
    go. It then execs (the pipe reads EOF) or says why it could not. Returns (pid in the
    sandbox, host pid). Blocking: run in a thread."""
    control.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        said, fds, _, _ = socket.recv_fds(control, _CONTROL_LIMIT, 1)
    except TimeoutError:
        raise _ServerSilent from None
    except OSError:
        said, fds = b"", []
    with contextlib.ExitStack() as stack:
        for fd in fds:
            stack.callback(os.close, fd)
        try:
            told = json.loads(said.split(b"\n", 1)[0]) if said else {}
        except ValueError:
            raise _NotEntered from None
        if not isinstance(told, dict):
            raise _NotEntered
        if "error" in told and not fds:  # it could not be forked
            raise _start_error(str(told["error"]))
        try:
            pid = int(told["pid"])
            (report,) = fds
        except (ValueError, KeyError, TypeError):
            raise _NotEntered from None
        host_pid = child_with_pid(server_pid, pid)
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
    """The process never said its pid: the server ended first."""


class _ServerSilent(TimeoutError):
    """The server forked nothing for the command in time: it is stopped or wedged."""


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


def _start_error(reason: str) -> Exception:
    if "No such file" in reason:
        return FileMissing(f"the process could not start: {reason}")
    if "Permission denied" in reason or "Not a directory" in reason:
        return FileAccessError(f"the process could not start: {reason}")
    return SandboxStartError(f"the process could not start: {reason}")


async def _abandon(master: int | None, group: ProcessCgroup | None) -> None:
    """Undo a start that failed half-way: nothing of it may be left running or open (the
    process itself was killed by its server, or ends by itself once its control closes; its
    group holds whatever it started)."""
    if group is not None:
        await group.kill_all()
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
    """A process in a local sandbox, forked by its command server; the process, `host_pid`,
    leads its own session and process group."""

    def __init__(
        self,
        end: Awaitable[int],
        pid: int,
        host_pid: int,
        master: int | None,
        pipes: _Pipes | None,
        group: ProcessCgroup | None,
        sandbox_cgroup: SandboxCgroup | None,
    ) -> None:
        self.pid = pid
        self.host_pid = host_pid
        self._end_code = end
        self._code: int | None = None
        self._master = master
        self._pipes = pipes
        # The reader closes `master` at the terminal's end; sizes are set on a copy of it that
        # lives until wait(), so a number reused meanwhile is never touched.
        self._sizer = os.dup(master) if master is not None else None
        self._group = group
        self._sandbox_cgroup = sandbox_cgroup
        self._oom_kills = sandbox_cgroup.oom_kills() if sandbox_cgroup is not None else 0
        self._stdin_writer: asyncio.StreamWriter | None = None
        self._terminal_writer: asyncio.StreamWriter | None = None
        self._terminal_opened: asyncio.Future[asyncio.StreamReader] | None = None
        self._pipes_opened: asyncio.Future[dict[Stream, asyncio.StreamReader]] | None = None
        self._end: ProcessEnd | None = None

    async def output(self) -> AsyncIterator[tuple[Stream, bytes]]:
        readers: dict[Stream, asyncio.StreamReader]
        if self._master is not None:
            readers = {"pty": await self._terminal()}
        else:
            readers = await self._opened_pipes()
        async for item in merged(readers):
            yield item

    async def _opened_pipes(self) -> dict[Stream, asyncio.StreamReader]:
        """stdout and stderr read through the event loop, and stdin written through it; opened
        once (output() and write_stdin() may both ask at the same time)."""
        if self._pipes_opened is None:
            self._pipes_opened = asyncio.ensure_future(self._open_pipes())
        return await asyncio.shield(self._pipes_opened)

    async def _open_pipes(self) -> dict[Stream, asyncio.StreamReader]:
        assert self._pipes is not None
        loop = asyncio.get_running_loop()
        readers: dict[Stream, asyncio.StreamReader] = {}
        pipes: tuple[tuple[Stream, int], ...] = (
            ("stdout", self._pipes.stdout),
            ("stderr", self._pipes.stderr),
        )
        for name, fd in pipes:
            reader = readers[name] = asyncio.StreamReader(limit=1 << 16)
            await loop.connect_read_pipe(
                functools.partial(asyncio.StreamReaderProtocol, reader),
                os.fdopen(fd, "rb", buffering=0),
            )
        if self._pipes.stdin is not None:
            transport, protocol = await loop.connect_write_pipe(
                lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
                os.fdopen(self._pipes.stdin, "wb", buffering=0),
            )
            self._stdin_writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return readers

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
        stdin = await self._stdin()
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
        stdin = await self._stdin()
        if not stdin.is_closing():
            stdin.close()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await stdin.wait_closed()

    async def _stdin(self) -> asyncio.StreamWriter:
        if self._pipes is None or self._pipes.stdin is None:
            raise ProcessStateError(
                f"process {self.pid} was started without input: start it with stdin set to "
                "send it any"
            )
        await self._opened_pipes()
        assert self._stdin_writer is not None
        return self._stdin_writer

    async def signal(self, signum: int) -> None:
        if self._group is not None:
            await asyncio.to_thread(self._group.signal, signum)
            if signum == signal.SIGKILL:
                await self._group.kill_all()
        elif self._code is None and not _ended(self._end_code):
            # Not reaped yet (once it is, its group's number may be another process's).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.host_pid, signum)

    async def resize(self, size: TerminalSize) -> None:
        if self._master is None:
            raise ProcessStateError(f"process {self.pid} has no terminal to resize")
        if self._sizer is None:
            raise ProcessStateError(f"process {self.pid} has ended: its terminal is gone")
        _set_size(self._sizer, size)

    async def wait(self) -> ProcessEnd:
        if self._end is None:
            code = self._code = await self._end_code
            for writer in (self._terminal_writer, self._stdin_writer):
                if writer is not None:
                    writer.close()
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


def _ended(end: Awaitable[int]) -> bool:
    return isinstance(end, asyncio.Future) and end.done()
