"""Processes in a Docker sandbox under runc, through a command server in the kernel's container.

An exec per command costs the engine's round trips (~35 ms for an `echo hi`); one exec per
container starts `inside_kernel/command_server.py` instead, as the sandbox's uid, confined by the
container as the kernel is, and it forks every command from then on. It reaches the host
through a socket the host listens on in the kernel's directory (bound into the container): the
host accepts one connection, whose peer must be the very process the engine says it started
(SO_PEERCRED against `exec_inspect`); anything else in the sandbox that connects first is
refused. When that cannot be checked (the service sees no pids of the engine's, say), the
sandbox's commands go on as execs (docker_processes.py), as they do under gVisor, whose
sandboxes reach no host socket.

A command's environment is the container's (as an exec's is) with the session's variables and
its own on top, its marker among them (docker_processes.py says why): its signals go through the
server, to its group and to every process holding its marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.backends.docker_exec_connection import engine_reason
from sandbox.backends.docker_processes import MARKER_VARIABLE, DockerSpawner, transient
from sandbox.cgroups import ProcessCgroup
from sandbox.kernel.connection import KERNEL_DIR_IN_SANDBOX
from sandbox.kernel.programs import COMMAND_SERVER_IN_SANDBOX
from sandbox.processes.command_server import MESSAGE_LIMIT, CommandServer, child_with_pid
from sandbox.processes.served import (
    SANDBOX_END_S,
    ServedProcess,
    ServedSpawner,
    StartAgain,
    Started,
)
from sandbox.processes.spawned import SpawnedProcess

START_TIMEOUT_S = 30.0
_BACKLOG = 16
_REFUSED_AT_MOST = 16  # connections not the server's before it is given up for this start
_UNVERIFIED_AT_MOST = 3  # starts in a row whose server cannot be verified: then execs for good
_UCRED = struct.Struct("iII")  # pid, uid, gid


class Unverifiable(SandboxStartError):
    """The server's peer could not be checked to be the exec the engine started."""


async def start_in_container(
    api: Any, container: str, user: str, python: str, kernel_dir: Path
) -> CommandServer:
    """Start a server in `container` (the sandbox's current kernel's) and take its connection."""
    name = f"commands-{secrets.token_hex(8)}.sock"
    path = kernel_dir / name
    loop = asyncio.get_running_loop()
    listener = await asyncio.to_thread(_listen, kernel_dir, name)
    try:
        argv = [python, "-I", "-S", COMMAND_SERVER_IN_SANDBOX, "--connect"]
        argv += [f"{KERNEL_DIR_IN_SANDBOX}/{name}", WORKSPACE_IN_SANDBOX]
        exec_id = await asyncio.to_thread(start_exec, api, container, user, argv)
        refused: list[int] = []
        async with asyncio.timeout(START_TIMEOUT_S):
            connection, host_pid = await _the_exec_connects(api, exec_id, listener, loop, refused)
    except TimeoutError:
        if refused:  # others came, never the exec's own: its pid is not as this service sees it
            raise Unverifiable("the command server's connection was never told apart") from None
        raise SandboxStartError("the sandbox's command server did not start in time") from None
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            path.unlink()
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            said = await loop.sock_recv(connection, MESSAGE_LIMIT)
    except TimeoutError:
        connection.close()
        raise SandboxStartError(
            f"the sandbox's command server connected but said nothing in {START_TIMEOUT_S:g} s"
        ) from None
    if not said:  # it ended (killed from the sandbox, say) before saying it was ready
        connection.close()
        raise StartAgain("the sandbox's command server ended before it was ready")
    try:
        hello = json.loads(said)
    except ValueError:
        hello = None
    if not isinstance(hello, dict) or "pid" not in hello:
        connection.close()
        why = hello.get("error") if isinstance(hello, dict) else None
        why = str(why)[:200] if why else "it did not say its pid"  # the sandbox's word: bounded
        raise SandboxStartError(f"the sandbox's command server did not start properly: {why}")
    return CommandServer(connection, serves=container, host_pid=host_pid)


def _listen(kernel_dir: Path, name: str) -> socket.socket:
    """A socket listening at `kernel_dir/name`, which the sandbox's uid may connect to. It is
    made and opened up in a directory of the service's own inside it, reached by descriptor,
    then moved out: the kernel's directory may still be the sandbox's to write (its kernel
    starting), and a chmod by name there could be sent through a link it planted. Unverifiable if
    it cannot be (a service that is not root may not add to a sealed kernel directory): the
    sandbox's commands are then execs."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staging = f".staging-{secrets.token_hex(8)}"
    kernel_fd = staging_fd = -1
    try:
        kernel_fd = os.open(kernel_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        os.mkdir(staging, 0o700, dir_fd=kernel_fd)
        flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        staging_fd = os.open(staging, flags, dir_fd=kernel_fd)
        if os.fstat(staging_fd).st_uid != os.geteuid():  # swapped for another: not ours
            raise OSError(f"{staging} in the kernel's directory is not the service's")
        # Through the descriptor: a socket's path has room for 107 bytes, and names under
        # `staging` are the service's alone.
        inside = f"/proc/self/fd/{staging_fd}/{name}"
        listener.bind(inside)
        os.chmod(inside, 0o666)
        listener.listen(_BACKLOG)
        listener.setblocking(False)
        os.rename(name, name, src_dir_fd=staging_fd, dst_dir_fd=kernel_fd)
    except OSError as exc:
        listener.close()
        raise Unverifiable(f"the command server's socket could not be made: {exc}") from None
    finally:
        if staging_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=staging_fd)
            os.close(staging_fd)
        if kernel_fd >= 0:
            with contextlib.suppress(OSError):
                os.rmdir(staging, dir_fd=kernel_fd)
            os.close(kernel_fd)
    return listener


def start_exec(api: Any, container: str, user: str, argv: list[str]) -> str:
    """Start the server's exec (blocking); StartAgain if the engine refused it for now."""
    try:
        exec_id: str = api.exec_create(container, argv, user=user, workdir="/")["Id"]
        api.exec_start(exec_id, detach=True)
    except (APIError, DockerException) as exc:
        reason = engine_reason(exc)
        if transient(reason):
            raise StartAgain(f"the engine could not start the command server: {reason}") from None
        raise SandboxStartError(
            f"the engine could not start the sandbox's command server: {reason}"
        ) from None
    return exec_id


async def _the_exec_connects(
    api: Any,
    exec_id: str,
    listener: socket.socket,
    loop: asyncio.AbstractEventLoop,
    refused: list[int],
) -> tuple[socket.socket, int]:
    """The connection of the exec's own process; StartAgain if the exec never started (the
    sandbox had no free pid, most likely)."""
    started_pid = 0
    delay = 0.01
    settle = time.monotonic() + 2.0  # an exec not running by then never started
    accepting = asyncio.ensure_future(loop.sock_accept(listener))
    try:
        while True:
            done, _ = await asyncio.wait({accepting}, timeout=delay)
            if not done:
                state = await asyncio.to_thread(api.exec_inspect, exec_id)
                started_pid = int(state.get("Pid") or 0)
                if not state.get("Running"):
                    if started_pid:
                        raise SandboxStartError(
                            "the sandbox's command server ended as it started (exit status "
                            f"{state.get('ExitCode')})"
                        )
                    if state.get("ExitCode") is not None or time.monotonic() > settle:
                        raise StartAgain("the engine could not start the sandbox's command server")
                delay = min(delay * 2, 0.5)
                continue
            connection, _ = accepting.result()
            pid, _, _ = _UCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            if not started_pid:
                state = await asyncio.to_thread(api.exec_inspect, exec_id)
                started_pid = int(state.get("Pid") or 0)
            if pid > 0 and pid == started_pid:
                connection.setblocking(False)
                return connection, pid
            connection.close()
            refused.append(pid)
            if pid == 0 or started_pid == 0 or len(refused) > _REFUSED_AT_MOST:
                raise Unverifiable("the command server's connection cannot be told from another's")
            accepting = asyncio.ensure_future(loop.sock_accept(listener))
    finally:
        if not accepting.done():
            accepting.cancel()


class DockerServedSpawner(ServedSpawner):
    """Commands through the current kernel container's server; as execs where its connection
    cannot be verified."""

    def __init__(
        self,
        client: docker.DockerClient,
        container: Callable[[], tuple[str | None, asyncio.Future[Any] | None]],
        user: str,
        environment: Callable[[], dict[str, str]],
        python: str,
        kernel_dir: Callable[[], Path],
    ) -> None:
        super().__init__()
        self._api = client.api
        self._container = container
        self._user = user
        self._environment = environment
        self._python = python
        self._kernel_dir = kernel_dir
        self._execs = DockerSpawner(client, container, user, environment)
        self._unverified = 0  # starts in a row whose server could not be verified
        # The death of each container a server was started in, by the container's name.
        self._exits: dict[str, asyncio.Future[Any] | None] = {}

    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        if self._unverified < _UNVERIFIED_AT_MOST:
            try:
                process = await super().spawn(request)
            except Unverifiable:
                self._unverified += 1  # this one as an exec; after a few, every one
            else:
                self._unverified = 0
                return process
        return await self._execs.spawn(request)

    def _current_sandbox(self) -> str:
        container, _ = self._container()
        if container is None:
            raise SandboxStartError("the sandbox's kernel is not running; restart it and try again")
        return container

    async def _start_server(self, sandbox: int | str | None) -> CommandServer:
        assert isinstance(sandbox, str)
        _, exited = self._container()
        server = await start_in_container(
            self._api, sandbox, self._user, self._python, self._kernel_dir()
        )
        self._exits = {sandbox: exited}  # the one container it serves now
        return server

    def _command(self, request: ProcessRequest) -> tuple[dict[str, object], str | None]:
        marker = secrets.token_hex(12)
        env = {**self._environment(), **request.env, MARKER_VARIABLE: marker}
        spec: dict[str, object] = {
            "argv": request.full_argv(),
            "env": env,
            "inherit_env": True,  # the container's, as an exec's
            "cwd": request.cwd,
        }
        return spec, f"{MARKER_VARIABLE}={marker}"

    def _place(self, server: CommandServer, pid: int, group: ProcessCgroup | None) -> int:
        """Its host pid (a child of the server's, as the host sees it: verified at its start)."""
        assert server.host_pid is not None
        return child_with_pid(server.host_pid, pid)

    def _process(self, started: Started) -> SpawnedProcess:
        exited = self._exits.get(str(started.server.serves))
        return DockerServedProcess(
            started, exited, self._running_server, lambda: self._container()[0]
        )


class DockerServedProcess(ServedProcess):
    """Signalled through its server: its group, and whatever holds its marker. Its end is told
    in the words an exec's is (docker_processes.py)."""

    def __init__(
        self,
        started: Started,
        container_exited: asyncio.Future[Any] | None,
        current_server: Callable[[], Awaitable[CommandServer]],
        current_container: Callable[[], str | None],
    ) -> None:
        super().__init__(started)
        self._container_exited = container_exited
        self._current_server = current_server
        self._current_container = current_container
        self._sent: set[int] = set()

    async def signal(self, signum: int) -> None:
        """Through its server; through the sandbox's current one (by its marker alone) if its
        own was killed while it lives on."""
        assert self.started.marker is not None
        self._sent.add(signum)
        server = self.started.server
        if not server.alive and not self.reaped:
            server = await self._current_server()
        await server.signal(self.started.command, signum, self.started.marker)

    async def _unseen(self) -> ProcessEnd:
        if self._container_exited is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._container_exited), SANDBOX_END_S)
        exited = self._container_exited is not None and self._container_exited.done()
        if exited or self._current_container() != self.started.server.serves:
            return self._ending(-signal.SIGKILL)  # with its container
        return await super()._unseen()

    def _ending(self, code: int) -> ProcessEnd:
        if code >= 0:
            return ProcessEnd(exit_code=code, error=f"exit status {code}" if code else None)
        signum = -code
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        error = f"killed by {name}"
        if signum == signal.SIGKILL and signum not in self._sent:
            exited = self._container_exited is not None and self._container_exited.done()
            if exited or self._current_container() != self.started.server.serves:
                error = "killed with its container: the sandbox closed or its kernel was replaced"
            elif not self.started.server.alive:
                error = (
                    "killed with the sandbox's command server, which was ended from inside the "
                    "sandbox"
                )
            else:
                error += (
                    ", not sent through the API: the sandbox's memory limit (which kills the "
                    "largest process when it is reached) or a signal from inside the sandbox"
                )
        return ProcessEnd(exit_code=None, signal=signum, error=error)
