"""Processes started through a sandbox's command server (`command_server.py`), on any backend
that has one: the host makes a process's pipes (or terminal) and a control socket and hands
them over with the request; the server forks it; it says its pid, waits while the host places
it (a local sandbox puts it in a cgroup of its own), and execs. Its end comes from the server,
which reaps it. What differs between backends (how a server starts, where a process is placed,
how it is signalled) is the subclasses'."""

from __future__ import annotations

import asyncio
import contextlib
import errno
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
from abc import abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from code_interpreter_wire.errors import (
    FileAccessError,
    FileMissing,
    ProcessStateError,
    SandboxStartError,
)
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox.cgroups import ProcessCgroup
from sandbox.processes.command_server import SERVER_GONE, CommandFds, CommandServer, ServerGone
from sandbox.processes.spawned import SpawnedProcess, Spawner, merged

HANDSHAKE_TIMEOUT_S = 30.0
# A process whose server ended first was killed with its sandbox if the sandbox ends this soon.
SANDBOX_END_S = 2.0
# A start that failed for want of a process (the sandbox's pids limit: a fork bomb's leftovers
# may hold every pid for a while) is tried again, backing off, for this long.
RETRY_START_S = 60.0
TERMINAL_TYPE = "xterm-256color"
_CONTROL_LIMIT = 1 << 16  # the most a process may say before its exec


class StartAgain(SandboxStartError):
    """A start that failed for now (no free pid in the sandbox): nothing of it ran."""


@dataclass(frozen=True)
class Pipes:
    """The host's ends of a process's pipes (stdin's None when it reads /dev/null)."""

    stdin: int | None
    stdout: int
    stderr: int


@dataclass(frozen=True)
class Started:
    """A process its server forked and that has exec'd, as its spawner hands it over."""

    server: CommandServer
    command: int  # its id with its server
    end: asyncio.Future[int]  # its exit status, or -signal
    pid: int  # in the sandbox
    host_pid: int | None  # on the host, where the host sees it
    master: int | None  # its terminal's, if it has one
    pipes: Pipes | None  # else its pipes
    group: ProcessCgroup | None  # its cgroup, where it has one
    marker: str | None  # NAME=VALUE in its environment (and its descendants'), if any
    pidfd: int | None  # pins it, where the host sees it: its end when its server's is first


class ServedSpawner(Spawner):
    """Starts processes through the command server of the sandbox as it is now: started at its
    first command, again when the sandbox changed (a kernel restart) or the server is gone."""

    def __init__(self) -> None:
        self._server: CommandServer | None = None
        self._server_lock = asyncio.Lock()
        self._closed = False

    @abstractmethod
    def _current_sandbox(self) -> int | str | None:
        """Which sandbox processes join now (raise SandboxStartError if none runs)."""

    @abstractmethod
    async def _start_server(self, sandbox: int | str | None) -> CommandServer:
        """A new server in `sandbox`."""

    @abstractmethod
    def _command(self, request: ProcessRequest) -> tuple[dict[str, object], str | None]:
        """What the server is told of the request (argv, env, cwd), and the process's marker."""

    @abstractmethod
    def _process(self, started: Started) -> SpawnedProcess:
        """The backend's handle on a started process."""

    def _new_group(self) -> ProcessCgroup | None:
        """A cgroup of its own for the next process, where the backend makes one."""
        return None

    def _place(self, server: CommandServer, pid: int, group: ProcessCgroup | None) -> int | None:
        """Before it execs: its host pid, where the host sees it, after putting it in `group`.
        Blocking (a thread runs it)."""
        return None

    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(StartAgain),
            stop=stop_after_delay(RETRY_START_S),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._spawn_once(request)
        except StartAgain as exc:
            raise SandboxStartError(
                f"the process did not start within {RETRY_START_S:g} s: {exc}; the sandbox may "
                "be out of processes (its pids limit): end some, or restart its kernel"
            ) from None
        raise AssertionError("tenacity ends in a result or an error")

    async def _spawn_once(self, request: ProcessRequest) -> SpawnedProcess:
        server = await self._running_server()
        host_end, child_end = socket.socketpair()
        theirs: list[int] = [child_end.detach()]  # sent to the server, then closed here
        ours: list[int] = []  # kept: the host's ends of the process's pipes
        master: int | None = None  # kept: a terminal's
        group: ProcessCgroup | None = None
        pipes: Pipes | None = None
        command, end = server.expect()
        try:
            group = self._new_group()
            if request.terminal is not None:  # the server makes it, in the sandbox
                nothing = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                theirs.append(nothing)
                fds = CommandFds(nothing, nothing, nothing, theirs[0])
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
                pipes = Pipes(stdin_writer, stdout_reader, stderr_reader)
            spec, marker = self._command(request)
            spec["terminal"] = request.terminal is not None
            if request.terminal is not None:  # unless the process's environment names one
                spec["default_env"] = {"TERM": TERMINAL_TYPE}
            try:
                await server.send(command, spec, fds)
            except ServerGone:  # killed or stopped from inside the sandbox: again, with a new one
                server.forget(command)
                server = await self._running_server(replacing=server)
                command, end = server.expect()
                try:
                    await server.send(command, spec, fds)
                except ServerGone as exc:  # gone as it came (no memory to start in, say)
                    raise StartAgain(str(exc)) from None
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
        place = functools.partial(self._place, server)
        given: list[int] = []  # what the handshake's thread was given: a terminal's master
        handshaking = asyncio.ensure_future(
            asyncio.to_thread(handshake, host_end, place, group, request.terminal, given)
        )
        try:
            pid, host_pid, master, pidfd = await asyncio.shield(handshaking)
        except BaseException as exc:
            with contextlib.suppress(OSError):  # wakes the handshake's thread, if it still runs
                host_end.shutdown(socket.SHUT_RDWR)
            await server.kill(command)
            # Its thread is done before what it was given is closed (it may still use it).
            await asyncio.wait({handshaking}, timeout=HANDSHAKE_TIMEOUT_S)
            if handshaking.done() and not handshaking.cancelled() and not handshaking.exception():
                _, _, master, pidfd = handshaking.result()  # it started after all: killed now
                if pidfd is not None:
                    os.close(pidfd)
            elif given:
                master = given[0]
            server.forget(command)
            for fd in ours:
                os.close(fd)
            await _abandon(master, group)
            if isinstance(exc, _ServerSilent):
                server.wedged()
            if isinstance(exc, TimeoutError):
                raise SandboxStartError("the process did not start in time") from None
            if isinstance(exc, _NotEntered):  # it ended before it forked: nothing ran
                server.wedged()
                raise StartAgain(
                    "the sandbox's command server ended before it started the process (its "
                    "kernel is restarting, or it was killed from inside the sandbox)"
                ) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                host_end.shutdown(socket.SHUT_RDWR)
            host_end.close()
        return self._process(
            Started(server, command, end, pid, host_pid, master, pipes, group, marker, pidfd)
        )

    async def _running_server(self, replacing: CommandServer | None = None) -> CommandServer:
        if self._closed:
            raise SandboxStartError("the sandbox is closed")
        async with self._server_lock:
            sandbox = self._current_sandbox()
            current = self._server
            fresh = current is not None and current is not replacing and current.alive
            if current is not None and fresh and current.serves == sandbox:
                return current
            if current is not None:
                await current.close()
            self._server = await self._start_server(sandbox)
            return self._server

    async def close(self) -> None:
        self._closed = True
        async with self._server_lock:
            if self._server is not None:
                await self._server.close()


def handshake(
    control: socket.socket,
    place: functools.partial[int | None],
    group: ProcessCgroup | None,
    terminal: TerminalSize | None,
    given: list[int],
) -> tuple[int, int | None, int | None, int | None]:
    """A terminal's master comes first, from the server (appended to `given` as it comes, so a
    caller that gave up closes it); then the process says its pid in the sandbox, hands over a
    pipe that its exec closes, and waits; it is placed (`place(pid, group)`), and told to go.
    It then execs (the pipe reads EOF) or says why it could not. Returns (pid in the sandbox,
    host pid where known, the terminal's master, a pidfd of the process where its host pid is
    known: opened while it waits, so it is that process). Blocking: run in a thread."""
    control.settimeout(HANDSHAKE_TIMEOUT_S)
    master: int | None = None
    with contextlib.ExitStack() as stack:
        while True:
            told, fds = _told(control)
            for fd in fds:
                stack.callback(os.close, fd)
            if "error" in told and not fds:  # it could not be started
                if told.get("errno") == errno.EAGAIN:
                    raise StartAgain(str(told["error"]))
                raise _start_error(str(told["error"]))
            if told.get("terminal") is True and len(fds) == 1 and master is None:
                if not os.isatty(fds[0]):  # from the sandbox: it must be what it says
                    raise _NotEntered
                master = os.dup(fds[0])
                given.append(master)
                if terminal is not None:
                    set_size(master, terminal)
                continue
            try:
                pid = int(str(told["pid"]))
                (report,) = fds
            except (ValueError, KeyError, TypeError):
                raise _NotEntered from None
            break
        if (terminal is None) != (master is None):
            raise _NotEntered
        host_pid = place(pid, group)
        pidfd = os.pidfd_open(host_pid) if host_pid is not None else None
        try:
            control.sendall(b"go")
            said = _read_until_closed(report)
        except BaseException:
            if pidfd is not None:
                os.close(pidfd)
            raise
    if said:
        if pidfd is not None:
            os.close(pidfd)
        try:
            reason = str(json.loads(said.split(b"\n", 1)[0])["error"])
        except (ValueError, KeyError, TypeError):
            reason = "it ended before it ran"
        raise _start_error(reason)
    return pid, host_pid, master, pidfd


def _told(control: socket.socket) -> tuple[dict[str, object], list[int]]:
    """One line from the control socket (the server's, then the process's), with the descriptors
    it carried. Each is sent by one sendmsg, and every one but the last carries a descriptor,
    which a read never reads past; a read may join the last to nothing after it."""
    try:
        said, fds, _, _ = socket.recv_fds(control, _CONTROL_LIMIT, 1)
    except TimeoutError:
        raise _ServerSilent from None
    except OSError:
        said, fds = b"", []
    try:
        told = json.loads(said.split(b"\n", 1)[0]) if said else {}
    except ValueError:
        told = None
    if not isinstance(told, dict):
        for fd in fds:
            os.close(fd)
        raise _NotEntered
    return told, fds


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


def set_size(master: int, size: TerminalSize) -> None:
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


class _TerminalProtocol(asyncio.StreamReaderProtocol):
    """A terminal master's reader whose EIO (Linux's answer once every holder of the other side
    has closed it) is the end of the output: as an error, StreamReader would raise it in place
    of what it still holds, so a command that ended before its output was read lost all of it."""

    def connection_lost(self, exc: Exception | None) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.EIO:
            exc = None
        super().connection_lost(exc)


async def terminal_reader(master: int) -> asyncio.StreamReader:
    """`master` read through the event loop (which takes it over and closes it at its end)."""
    reader = asyncio.StreamReader(limit=1 << 16)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: _TerminalProtocol(reader), os.fdopen(master, "rb", buffering=0)
    )
    return reader


class ServedProcess(SpawnedProcess):
    """A process its sandbox's command server forked: it leads its own session and process
    group; its pipes (or terminal) are held here, its end comes from the server."""

    def __init__(self, started: Started) -> None:
        self.pid = started.pid
        self.started = started
        self._code: int | None = None
        self._master = started.master
        self._pipes = started.pipes
        # The reader closes `master` at the terminal's end; sizes are set on a copy of it that
        # lives until wait(), so a number reused meanwhile is never touched.
        self._sizer = os.dup(started.master) if started.master is not None else None
        self._stdin_writer: asyncio.StreamWriter | None = None
        self._terminal_writer: asyncio.StreamWriter | None = None
        self._terminal_opened: asyncio.Future[asyncio.StreamReader] | None = None
        self._pipes_opened: asyncio.Future[dict[Stream, asyncio.StreamReader]] | None = None
        self._end: ProcessEnd | None = None

    @property
    def reaped(self) -> bool:
        """It has ended: its pid (and group number) may be another process's now."""
        if self._end is not None or not self.started.end.done():
            return self._end is not None
        if self.started.end.result() != SERVER_GONE or self.started.pidfd is None:
            return True
        poller = select.poll()  # not select(): descriptors here pass 1024 under load
        poller.register(self.started.pidfd, select.POLLIN)
        return bool(poller.poll(0))  # it exited, unseen

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
        # Its copy first: once read to its end, the reader closes `master`, number and all.
        writing = os.fdopen(os.dup(self._master), "wb", buffering=0)
        try:
            reader = await terminal_reader(self._master)
        except BaseException:
            writing.close()
            raise
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), writing
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

    async def resize(self, size: TerminalSize) -> None:
        if self._master is None:
            raise ProcessStateError(f"process {self.pid} has no terminal to resize")
        if self._sizer is None:
            raise ProcessStateError(f"process {self.pid} has ended: its terminal is gone")
        try:
            set_size(self._sizer, size)
        except OSError as exc:
            raise ProcessStateError(
                f"process {self.pid}'s terminal cannot be resized: {exc}"
            ) from None

    async def wait(self) -> ProcessEnd:
        if self._end is None:
            code = await self.started.end
            if code == SERVER_GONE and self.started.pidfd is not None:
                await exit_of(self.started.pidfd)  # it outlived its server: followed here
            self._code = code
            if self.started.pidfd is not None:
                os.close(self.started.pidfd)
            for writer in (self._terminal_writer, self._stdin_writer):
                if writer is not None:
                    writer.close()
            if self._sizer is not None:
                os.close(self._sizer)
                self._sizer = None
            if self.started.group is not None:
                # When nothing it started still runs; else with the sandbox.
                self.started.group.remove()
            self._end = await self._unseen() if code == SERVER_GONE else self._ending(code)
        return self._end

    async def _unseen(self) -> ProcessEnd:
        """The end of a process whose server ended first: that it ended, not how (a backend
        that can tell it was killed with its whole sandbox says so)."""
        return ProcessEnd(
            exit_code=None,
            error="it ended, how is not known: the sandbox's command server, its parent, ended "
            "before it (killed from inside the sandbox, or with the sandbox)",
        )

    def _ending(self, code: int) -> ProcessEnd:
        if code >= 0:
            return ProcessEnd(
                exit_code=code, error=None if code == 0 else f"it exited with status {code}"
            )
        signum = -code
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        return ProcessEnd(exit_code=None, signal=signum, error=f"it was ended by {name}")


async def exit_of(pidfd: int) -> None:
    """Once the process `pidfd` pins has exited (it reads ready then)."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, ready)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
