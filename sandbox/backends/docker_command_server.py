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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException

from code_interpreter_wire.errors import SandboxStartError
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.backends.docker_exec_connection import engine_reason
from sandbox.backends.docker_processes import MARKER_VARIABLE, DockerSpawner
from sandbox.kernel.connection import KERNEL_DIR_IN_SANDBOX
from sandbox.kernel.programs import COMMAND_SERVER_IN_SANDBOX
from sandbox.processes.command_server import MESSAGE_LIMIT, CommandServer
from sandbox.processes.served import ServedProcess, ServedSpawner, StartAgain, Started
from sandbox.processes.spawned import SpawnedProcess

START_TIMEOUT_S = 30.0
_UCRED = struct.Struct("iII")  # pid, uid, gid


class Unverifiable(SandboxStartError):
    """The server's peer could not be checked to be the exec the engine started."""


async def start_in_container(
    api: Any, container: str, user: str, python: str, kernel_dir: Path
) -> CommandServer:
    """Start a server in `container` (the sandbox's current kernel's) and take its connection."""
    name = f"commands-{secrets.token_hex(8)}.sock"
    path = kernel_dir / name
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loop = asyncio.get_running_loop()
    try:
        directory = os.open(kernel_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # through the directory's descriptor: a socket's path has room for 107 bytes
            listener.bind(f"/proc/self/fd/{directory}/{name}")
        finally:
            os.close(directory)
        os.chmod(path, 0o666)  # the directory is the sandbox's alone
        listener.listen(4)
        listener.setblocking(False)
        argv = [python, "-I", "-S", COMMAND_SERVER_IN_SANDBOX, "--connect"]
        argv += [f"{KERNEL_DIR_IN_SANDBOX}/{name}", WORKSPACE_IN_SANDBOX]

        def start() -> str:
            exec_id: str = api.exec_create(container, argv, user=user, workdir="/")["Id"]
            api.exec_start(exec_id, detach=True)
            return exec_id

        try:
            exec_id = await asyncio.to_thread(start)
        except (APIError, DockerException) as exc:
            raise SandboxStartError(
                f"the engine could not start the sandbox's command server: {engine_reason(exc)}"
            ) from None
        async with asyncio.timeout(START_TIMEOUT_S):
            connection = await _the_exec_connects(api, exec_id, listener, loop)
    except TimeoutError:
        raise SandboxStartError("the sandbox's command server did not start in time") from None
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            path.unlink()
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            said = await loop.sock_recv(connection, MESSAGE_LIMIT)
        if "pid" not in json.loads(said or b"{}"):
            raise ValueError(said)
    except (TimeoutError, ValueError, TypeError):
        connection.close()
        raise SandboxStartError("the sandbox's command server did not start properly") from None
    return CommandServer(connection, serves=container)


async def _the_exec_connects(
    api: Any, exec_id: str, listener: socket.socket, loop: asyncio.AbstractEventLoop
) -> socket.socket:
    """The connection of the exec's own process; StartAgain if the exec ended first (the engine
    could not start it: the sandbox had no free pid, most likely)."""
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
                ended = state.get("ExitCode") is not None or time.monotonic() > settle
                if not state.get("Running") and ended:
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
                return connection
            connection.close()
            if pid == 0 or started_pid == 0:
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
        self._execs_only = False

    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        if not self._execs_only:
            try:
                return await super().spawn(request)
            except Unverifiable:
                self._execs_only = True
        return await self._execs.spawn(request)

    def _current_sandbox(self) -> str:
        container, _ = self._container()
        if container is None:
            raise SandboxStartError("the sandbox's kernel is not running; restart it and try again")
        return container

    async def _start_server(self, sandbox: int | str | None) -> CommandServer:
        assert isinstance(sandbox, str)
        return await start_in_container(
            self._api, sandbox, self._user, self._python, self._kernel_dir()
        )

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

    def _process(self, started: Started) -> SpawnedProcess:
        _, exited = self._container()
        return DockerServedProcess(started, exited)


class DockerServedProcess(ServedProcess):
    """Signalled through its server: its group, and whatever holds its marker."""

    def __init__(self, started: Started, container_exited: asyncio.Future[Any] | None) -> None:
        super().__init__(started)
        self._container_exited = container_exited
        self._sent: set[int] = set()

    async def signal(self, signum: int) -> None:
        assert self.started.marker is not None
        self._sent.add(signum)
        await self.started.server.signal(self.started.command, signum, self.started.marker)

    def _ending(self, code: int) -> ProcessEnd:
        end = super()._ending(code)
        if end.signal != signal.SIGKILL or signal.SIGKILL in self._sent:
            return end
        if not self.started.server.alive or (
            self._container_exited is not None and self._container_exited.done()
        ):
            error = "killed with its container: the sandbox closed or its kernel was replaced"
        else:
            error = (
                "killed by SIGKILL, not sent through the API: the sandbox's memory limit (which "
                "kills the largest process when it is reached) or a signal from inside the sandbox"
            )
        return end.model_copy(update={"error": error})
