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
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from code_interpreter_wire.errors import SandboxStartError
from sandbox import seccomp
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.host_commands import memfd_with

log = logging.getLogger(__name__)

SERVER_FILE = Path(__file__).parent.parent / "inside_kernel" / "command_server.py"
SERVER_IN_SANDBOX = "/opt/code-interpreter/command_server.py"
START_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 30.0  # a server that takes no command for this long is stopped or wedged
_NS_GET_USERNS = 0xB701  # ioctl: the user namespace that owns a namespace
_MESSAGE_LIMIT = 1 << 12  # the most one message from the server may hold
# A send failing with one of these found the server gone; any other refused this one message.
_GONE = {errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF}


class ServerSettings(Protocol):
    """What starting a server needs of the local backend's process settings."""

    @property
    def python(self) -> str: ...
    @property
    def nsenter(self) -> str | None: ...
    @property
    def workspace(self) -> Path: ...
    @property
    def preexec(self) -> Any: ...


class ServerGone(SandboxStartError):
    """The server ended (killed from inside, or with its sandbox) before it took a command."""


@dataclass(frozen=True)
class CommandFds:
    """What a command's process is given, in this order: its stdin, stdout, stderr, and the
    control socket of its start (`local_processes._handshake`)."""

    stdin: int
    stdout: int
    stderr: int
    control: int


class CommandServer:
    """A running server: sends it commands, and resolves each one's end as the server tells it
    (an exit status, or -signal, as asyncio's `returncode`)."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        connection: socket.socket,
        host_pid: int,
        init: int | None,
    ) -> None:
        self.host_pid = host_pid  # the parent, on the host, of every command it forks
        self.init = init  # the sandbox init it entered (None: no sandbox)
        self._proc = proc
        self._connection = connection
        self._ends: dict[int, asyncio.Future[int]] = {}
        self._next_id = 0
        self._sending = asyncio.Lock()
        self._wedged = False
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, settings: ServerSettings, init: int | None) -> CommandServer:
        """Start one in the sandbox whose init is `init` (None: unsafe, no sandbox)."""
        connection, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [server_end.detach()]
        try:
            spec: dict[str, object] = {"connection_fd": fds[0]}
            if settings.nsenter is None or init is None:
                argv = [settings.python, "-I", "-S", str(SERVER_FILE)]
                spec["workspace"] = str(settings.workspace)
            else:
                outer_userns, inner_userns = _namespaces(init, fds)
                fds.append(memfd_with("seccomp", seccomp.bpf_program()))
                spec.update(workspace=WORKSPACE_IN_SANDBOX, userns_fd=inner_userns)
                spec["seccomp_fd"] = fds[-1]
                argv = [
                    settings.nsenter, f"--target={init}",
                    f"--user=/proc/self/fd/{outer_userns}", "--preserve-credentials",
                    "--mount", "--pid", "--ipc", "--uts", "--net", "--cgroup",
                    "--root", "--wd", "--",
                    settings.python, "-I", "-S", SERVER_IN_SANDBOX,
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
            hearing = loop.sock_recv(connection, _MESSAGE_LIMIT)
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
        return cls(proc, connection, host_pid, init)

    @property
    def alive(self) -> bool:
        return not self._reader.done() and not self._wedged

    def wedged(self) -> None:
        """It stopped taking commands or starting them (code in the sandbox can stop it): the
        next command replaces it."""
        self._wedged = True

    def expect(self) -> tuple[int, asyncio.Future[int]]:
        """A new command's id and the future of its end, made before it is sent (its end can
        come before the sender hears of its start)."""
        self._next_id += 1
        end: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if not self.alive:
            end.set_result(-signal.SIGKILL)
        self._ends[self._next_id] = end
        return self._next_id, end

    def forget(self, command: int) -> None:
        """A command that never started: no end will come for it."""
        self._ends.pop(command, None)

    async def send(self, command: int, spec: dict[str, object], fds: CommandFds) -> None:
        """Hand it a command: its JSON (any size) in a memfd, the descriptors it gets."""
        spec_fd = memfd_with("command", json.dumps(spec).encode())
        try:
            descriptors = [fds.stdin, fds.stdout, fds.stderr, fds.control, spec_fd]
            await self._send({"id": command}, descriptors)
        finally:
            os.close(spec_fd)

    async def kill(self, command: int) -> None:
        """Kill a command whose start was given up (best effort: it may have ended)."""
        with contextlib.suppress(SandboxStartError):
            await self._send({"kill": command}, [])

    async def _send(self, message: dict[str, int], descriptors: list[int]) -> None:
        loop = asyncio.get_running_loop()
        data = json.dumps(message).encode()
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S), self._sending:
                while True:
                    try:
                        socket.send_fds(self._connection, [data], descriptors)
                        return
                    except BlockingIOError:
                        writable = loop.create_future()
                        loop.add_writer(self._connection, writable.set_result, None)
                        try:
                            await writable
                        finally:
                            loop.remove_writer(self._connection)
        except TimeoutError:
            self.wedged()
            raise ServerGone("the sandbox's command server took no command in time") from None
        except OSError as exc:
            if exc.errno in _GONE:
                raise ServerGone(
                    "the sandbox's command server has ended (its kernel is restarting or "
                    "the sandbox is closing); try again in a moment"
                ) from exc
            raise SandboxStartError(f"the process could not be handed over: {exc}") from exc

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while said := await loop.sock_recv(self._connection, _MESSAGE_LIMIT):
                try:
                    told = json.loads(said)
                    command, code = int(told["exited"]), int(told["code"])
                except (ValueError, KeyError, TypeError):
                    log.warning("the command server of sandbox init %s said nonsense", self.init)
                    break
                end = self._ends.pop(command, None)
                if end is not None and not end.done():
                    end.set_result(code)
        except OSError:
            pass
        finally:
            # Gone: its commands were killed with it (their parent-death signal).
            for end in self._ends.values():
                if not end.done():
                    end.set_result(-signal.SIGKILL)
            self._ends.clear()
            self._connection.close()
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()

    async def close(self) -> None:
        """End it (and, with it, whatever it still runs)."""
        with contextlib.suppress(OSError):
            self._connection.shutdown(socket.SHUT_RDWR)
        await asyncio.shield(self._reader)


def _namespaces(init: int, fds: list[int]) -> tuple[int, int]:
    """The sandbox's outer user namespace (it owns the others) and the kernel's own, nested
    in it (bwrap's --disable-userns): nsenter enters the first, the server the second."""
    pid_ns = os.open(f"/proc/{init}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fds.append(fcntl.ioctl(pid_ns, _NS_GET_USERNS))
    finally:
        os.close(pid_ns)
    fds.append(os.open(f"/proc/{init}/ns/user", os.O_RDONLY | os.O_CLOEXEC))
    return fds[-2], fds[-1]


def child_with_pid(parent: int, sandbox_pid: int) -> int:
    """The host pid of `parent`'s child whose pid in its sandbox is `sandbox_pid`."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:  # the parent (a command server) is gone
        children = []
    for child in children:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == str(sandbox_pid):
                    return int(child)
    raise SandboxStartError("the process that entered the sandbox could not be found")


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    if proc.stderr is None:
        return "it ended before it ran"
    with contextlib.suppress(Exception):
        text = (await asyncio.wait_for(proc.stderr.read(4096), 5)).decode(errors="replace")
        if text.strip():
            return text.strip()
    return "it ended before it ran"
