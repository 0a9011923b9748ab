"""Processes in a Docker sandbox as execs in the kernel's container, through the engine's exec
API: under gVisor, and wherever a command server's connection cannot be verified (under runc a
command server forks them instead: docker_command_server.py).

So a process shares everything the kernel has: the container's namespaces, cgroup (memory, CPU
and pids limits), seccomp profile, dropped capabilities, ulimits, read-only root, /tmp, the
workspace and the absence of a network, as the sandbox's own uid. The container is per kernel,
so replacing the kernel (a restart, or its death) ends its processes too.

How a process is followed:
- A tiny `sh` wrapper enters the working directory, sets the terminal's size, reports its pid
  on its first line of stderr (of the terminal, for one) and `exec`s the command, which thus
  keeps that pid. runc makes every exec a session and group leader, so that pid is its group.
- The output comes over the hijacked connection of `exec_start(socket=True)`, read by asyncio:
  raw for a terminal, else stdout and stderr multiplexed in frames with an 8-byte header, which
  are taken apart here piece by piece (never more than one chunk held). Closing stdin is a
  half-close of that connection (shutdown(SHUT_WR)).
- Signals are sent from inside the container by an exec of bash builtins (no fork, so it runs
  even while a fork bomb holds every pid; the engine may still fail to start it then, so it is
  started again until the engine says it ran, never sent twice; docker_signals.py), as the
  sandbox's uid: to the process's group, then to every process whose environment holds the
  process's own marker variable. Every descendant
  inherits that marker, so what escaped the group (setsid, double fork, a daemon) is signalled
  as well, and nothing else in the container is: not the kernel, not another process. Only a
  descendant that wiped its environment escapes the marker; it still dies with the container
  when the sandbox closes or its kernel is replaced. (The container's cgroup holds the kernel
  too, so it cannot tell a process's descendants apart; and a sweep from the host would need the
  orchestrator to be root in the engine's PID namespace, which a remote engine never gives.)
- Its end comes from `exec_inspect`: a death by signal N shows as 128+N (as in a shell).
- An exec the engine could not start (its pid is 0: runc's own setup needs a free pid, which a
  fork bomb's leftovers may all hold for a while) ends before the wrapper's first line; nothing
  of the command ran, so it is started again, backing off, until START_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import signal as signals
import struct
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound

from code_interpreter_wire.errors import (
    FileMissing,
    ProcessStateError,
    SandboxError,
)
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
from sandbox.backends.docker_exec_connection import engine_reason, take_connection
from sandbox.backends.docker_signals import SIGNALLERS, send_signal
from sandbox.processes.spawned import CHUNK_BYTES, SpawnedProcess, Spawner

# Every process carries this variable, with a value of its own; its descendants inherit it.
MARKER_VARIABLE = "CODE_INTERPRETER_PROCESS"
START_TIMEOUT_S = 60.0  # for the wrapper's first line, on a loaded engine
_PID_PREFIX = b"cir-pid "
_NO_DIRECTORY = b"cir-no-directory"
_FIRST_LINE_MAX = 4096
# Once its container died, output still in flight has this long to arrive before the
# connection of one of its processes is closed.
_DRAIN_AFTER_DEATH_S = 1.0
# $1 working directory, $2 terminal size for stty (or empty), then the command.
_WRAPPER = (
    'cd -- "$1" 2>/dev/null || { echo cir-no-directory >&2; exit 126; }; '
    '[ -z "$2" ] || stty $2 2>/dev/null; '
    "shift 2; "
    'echo "cir-pid $$" >&2; '
    'exec "$@"'
)
_FRAME_HEADER = struct.Struct(">BxxxL")
_FRAME_STREAMS: dict[int, Stream] = {0: "stdout", 1: "stdout", 2: "stderr"}


class DockerSpawner(Spawner):
    """Starts processes in the container that runs a sandbox's current kernel."""

    def __init__(
        self,
        client: docker.DockerClient,
        container: Callable[[], tuple[str | None, asyncio.Future[Any] | None]],
        user: str,
        environment: Callable[[], dict[str, str]],
    ) -> None:
        self._api = client.api
        self._container = container
        self._user = user
        self._environment = environment

    async def spawn(self, request: ProcessRequest) -> DockerProcess:
        container, container_exited = self._container()
        if container is None:
            raise SandboxError("the sandbox's kernel is not running; restart it and try again")
        marker = f"{MARKER_VARIABLE}={secrets.token_hex(12)}"
        env = {**self._environment(), **request.env}
        env[MARKER_VARIABLE] = marker.partition("=")[2]
        size = request.terminal
        stty = f"rows {size.rows} cols {size.cols}" if size is not None else ""
        cwd = request.cwd or WORKSPACE_IN_SANDBOX
        command = ["/bin/sh", "-c", _WRAPPER, "sh", cwd, stty, *request.full_argv()]
        tty = size is not None
        options: dict[str, Any] = {
            "stdout": True,
            "stderr": True,
            "stdin": request.stdin or tty,
            "tty": tty,
            "user": self._user,
            "workdir": WORKSPACE_IN_SANDBOX,
            "environment": [f"{k}={v}" for k, v in env.items()],
        }
        deadline = time.monotonic() + START_TIMEOUT_S
        delay = 0.05
        while True:
            try:
                return await self._start_once(
                    container, container_exited, command, options, marker, cwd, deadline
                )
            except _NotStarted as exc:
                if not transient(str(exc)) or time.monotonic() + delay >= deadline:
                    raise SandboxError(
                        f"the process did not start within {START_TIMEOUT_S:g} s: {exc}; the "
                        "sandbox may be out of processes (its pids limit): end some, or restart "
                        "its kernel"
                    ) from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _start_once(
        self,
        container: str,
        container_exited: asyncio.Future[Any] | None,
        command: list[str],
        options: dict[str, Any],
        marker: str,
        cwd: str,
        deadline: float,
    ) -> DockerProcess:
        """One exec of the wrapper, up to its first line; `_NotStarted` if the engine ended it
        before that line (nothing of the command ran)."""
        starting = asyncio.ensure_future(
            asyncio.to_thread(self._start, container, command, options)
        )
        try:
            exec_id, hijacked = await asyncio.shield(starting)
        except asyncio.CancelledError:  # the caller left: so does the process, once started
            starting.add_done_callback(
                functools.partial(self._abandon, container=container, marker=marker)
            )
            raise
        except (APIError, DockerException) as exc:
            raise SandboxError(
                f"the engine could not start the process: {engine_reason(exc)}"
            ) from None
        try:
            connection, leftover = take_connection(hijacked)
            reader, writer = await asyncio.open_connection(sock=connection)
        except BaseException:
            self._abandon(starting, container=container, marker=marker)
            raise
        source = _Source(reader, leftover)
        process = DockerProcess(
            self._api,
            container,
            self._user,
            exec_id,
            source,
            writer,
            tty=options["tty"],
            stdin=options["stdin"],
            marker=marker,
        )
        if container_exited is not None:
            process.end_with(container_exited)
        try:
            await asyncio.wait_for(process.read_pid(), max(deadline - time.monotonic(), 0.01))
        except _NotStarted:
            process.discard_unstarted()
            raise
        except BaseException as exc:
            await process.discard()
            if isinstance(exc, TimeoutError):
                raise SandboxError(
                    f"the process did not start within {START_TIMEOUT_S:g} s; the sandbox may "
                    "be overloaded"
                ) from None
            if isinstance(exc, _DirectoryMissing):
                raise FileMissing(
                    f"the working directory {cwd!r} does not exist in the sandbox; create it "
                    "or give another cwd"
                ) from None
            raise
        return process

    def _start(
        self, container: str, command: list[str], options: dict[str, Any]
    ) -> tuple[str, Any]:
        exec_id: str = self._api.exec_create(container, command, **options)["Id"]
        return exec_id, self._api.exec_start(exec_id, tty=options["tty"], socket=True)

    def _abandon(
        self, starting: asyncio.Future[tuple[str, Any]], *, container: str, marker: str
    ) -> None:
        """A process whose caller left while it started: close its connection and kill it."""
        if starting.cancelled() or starting.exception() is not None:
            return
        _, hijacked = starting.result()
        with contextlib.suppress(Exception):
            hijacked.close()
        kill = functools.partial(
            send_signal, self._api, container, self._user, signals.SIGKILL, None, marker
        )
        loop = asyncio.get_running_loop()
        _abandoned.add(task := asyncio.ensure_future(loop.run_in_executor(SIGNALLERS, kill)))
        task.add_done_callback(_forget)


# Kills of abandoned processes under way (kept referenced until they finish).
_abandoned: set[asyncio.Future[None]] = set()


def _forget(task: asyncio.Future[None]) -> None:
    _abandoned.discard(task)
    if not task.cancelled():
        task.exception()  # its container may be gone already: nothing is left to kill


_KILLED_WITH_CONTAINER = ProcessEnd(
    exit_code=None,
    signal=int(signals.SIGKILL),
    error="killed with its container: the sandbox closed or its kernel was replaced",
)


class _DirectoryMissing(Exception):
    pass


class _NotStarted(Exception):
    """The engine could not start an exec (its pid is 0): nothing of it ran."""


# What the engine says when it could not start a process for want of a free pid or memory
# (runc's own setup forks in the container), or says nothing: worth another try.
_TRANSIENT = ("resource temporarily unavailable", "init-p", "fork", "cannot allocate memory")


def transient(said: str) -> bool:
    """Whether the engine's refusal of an exec is for now (no free pid in the sandbox)."""
    return not said or "ended its stream" in said or any(t in said.lower() for t in _TRANSIENT)


class _Source:
    """The hijacked connection's bytes: first what docker-py had already buffered, then the
    socket's."""

    def __init__(self, reader: asyncio.StreamReader, leftover: bytes) -> None:
        self._reader = reader
        self._leftover = leftover

    async def read(self, limit: int) -> bytes:
        if self._leftover:
            chunk, self._leftover = self._leftover[:limit], self._leftover[limit:]
            return chunk
        return await self._reader.read(limit)

    async def read_exactly(self, size: int) -> bytes | None:
        """`size` bytes, or None at the end of the stream."""
        data = b""
        while len(data) < size:
            chunk = await self.read(size - len(data))
            if not chunk:
                return None
            data += chunk
        return data


class DockerProcess(SpawnedProcess):
    """One exec in the kernel's container, its connection held here."""

    def __init__(
        self,
        api: Any,
        container: str,
        user: str,
        exec_id: str,
        source: _Source,
        writer: asyncio.StreamWriter,
        *,
        tty: bool,
        stdin: bool,
        marker: str,
    ) -> None:
        self.pid = 0
        self._api = api
        self._container = container
        self._user = user
        self._exec_id = exec_id
        self._source = source
        self._writer = writer
        self._tty = tty
        self._stdin_open = stdin
        self._marker = marker
        self._early: list[tuple[Stream, bytes]] = []  # output read with the pid line
        self._pending_frame: tuple[Stream, int] | None = None  # a frame read in part
        self._sent: set[int] = set()
        self._container_exited: asyncio.Future[Any] | None = None

    # --- start
    def end_with(self, container_exited: asyncio.Future[Any]) -> None:
        """Close its connection shortly after its container dies. The engine normally ends an
        exec's stream with its container, but under gVisor it can keep it open: the output
        would then never end, nor the process with it."""
        loop = asyncio.get_running_loop()
        self._container_exited = container_exited

        def container_died(_: asyncio.Future[Any]) -> None:
            loop.call_later(_DRAIN_AFTER_DEATH_S, self._close_connection)

        container_exited.add_done_callback(container_died)

    async def read_pid(self) -> None:
        """Read up to the wrapper's first line, keeping what else came, and take the pid."""
        line = b""
        while b"\n" not in line:
            piece = await self._next()
            if piece is None and not line.strip():
                engine = b"".join(data for _, data in self._early).decode(errors="replace")
                if await self._never_started():
                    raise _NotStarted(
                        engine.strip() or "the engine ended its stream before it began"
                    )
            if piece is None:
                said = line or b"".join(data for _, data in self._early)
                raise SandboxError(
                    f"the process did not start: {said.decode(errors='replace').strip()}"
                )
            stream, data = piece
            if stream == "stdout":
                self._early.append(piece)
                continue
            line += data
            # The pid line and what the command wrote next can come in one piece (a slow
            # reader, a fork bomb's complaints): only a first line that never ends is refused.
            if b"\n" not in line[: _FIRST_LINE_MAX + 1] and len(line) > _FIRST_LINE_MAX:
                raise SandboxError("the process did not start: its wrapper said no pid")
        first, _, rest = line.partition(b"\n")
        first = first.rstrip(b"\r")
        if rest:
            self._early.append(("pty" if self._tty else "stderr", rest))
        if first == _NO_DIRECTORY:
            raise _DirectoryMissing()
        if not first.startswith(_PID_PREFIX) or not first[len(_PID_PREFIX) :].isdigit():
            raise SandboxError(f"the process did not start: {first.decode(errors='replace')}")
        self.pid = int(first[len(_PID_PREFIX) :])

    async def _never_started(self) -> bool:
        """Whether the engine says this exec never ran a process (pid 0): nothing of it ran,
        so it may be started again. A wrapper that ran and died before its first line did not."""
        try:
            state = await asyncio.get_running_loop().run_in_executor(
                SIGNALLERS, self._api.exec_inspect, self._exec_id
            )
        except (APIError, DockerException):
            return False
        return not state.get("Running") and not state.get("Pid")

    async def _next(self) -> tuple[Stream, bytes] | None:
        """The next piece of output (at most CHUNK_BYTES), or None at the end."""
        if self._tty:
            data = await self._source.read(CHUNK_BYTES)
            return ("pty", data) if data else None
        while True:
            if self._pending_frame is None:
                header = await self._source.read_exactly(_FRAME_HEADER.size)
                if header is None:
                    return None
                kind, length = _FRAME_HEADER.unpack(header)
                self._pending_frame = (_FRAME_STREAMS.get(kind, "stdout"), length)
            stream, left = self._pending_frame
            if left == 0:
                self._pending_frame = None
                continue
            data = await self._source.read(min(left, CHUNK_BYTES))
            if not data:
                return None
            self._pending_frame = (stream, left - len(data)) if left > len(data) else None
            return stream, data

    # --- SpawnedProcess
    async def output(self) -> AsyncIterator[tuple[Stream, bytes]]:
        try:
            for early in self._early:
                yield early
            self._early.clear()
            while (piece := await self._next()) is not None:
                yield piece
        except OSError:  # the engine dropped the connection: the output ends here
            return
        finally:
            self._close_connection()

    async def write_stdin(self, data: bytes) -> None:
        if not self._stdin_open:
            raise ProcessStateError(
                "this process's input is closed (or it was started without stdin=true)"
            )
        try:
            self._writer.write(data)
            await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            raise ProcessStateError(f"this process's input is closed: {exc}") from None

    async def close_stdin(self) -> None:
        if self._tty:  # a terminal's input ends with its EOF character, as typed
            await self.write_stdin(b"\x04")
            return
        if self._stdin_open:
            self._stdin_open = False
            with contextlib.suppress(OSError, RuntimeError):
                self._writer.write_eof()

    async def signal(self, signum: int) -> None:
        """To its group, and to everything carrying its marker (the module says why)."""
        if self.pid <= 0:
            raise ProcessLookupError("the process has no pid yet")
        self._sent.add(signum)
        send = functools.partial(
            send_signal, self._api, self._container, self._user, signum, self.pid, self._marker
        )
        try:
            await asyncio.get_running_loop().run_in_executor(SIGNALLERS, send)
        except ProcessLookupError:
            # Gone with its container. Under gVisor the engine can keep the exec's stream open
            # after the sandbox died: closed here, so its output ends and its end is read.
            self._close_connection()
            raise

    async def resize(self, size: TerminalSize) -> None:
        if not self._tty:
            raise ProcessStateError(
                "this process runs without a terminal: it has no size to change"
            )
        try:
            await asyncio.to_thread(
                self._api.exec_resize, self._exec_id, height=size.rows, width=size.cols
            )
        except (APIError, DockerException) as exc:
            raise SandboxError(f"could not resize the terminal: {engine_reason(exc)}") from None

    async def wait(self) -> ProcessEnd:
        """Its end from the engine, once the exec no longer runs (output can end before)."""
        delay = 0.02
        while True:
            try:
                state = await asyncio.to_thread(self._api.exec_inspect, self._exec_id)
            except NotFound:  # removed with force, which kills everything in it
                return _KILLED_WITH_CONTAINER
            except (APIError, DockerException) as exc:
                return ProcessEnd(exit_code=None, error=f"the engine lost it: {engine_reason(exc)}")
            if not state.get("Running") and state.get("ExitCode") is not None:
                return self._end(int(state["ExitCode"]))
            if self._container_exited is not None and self._container_exited.done():
                # Under gVisor the engine may report an exec of a dead container as running.
                return _KILLED_WITH_CONTAINER
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _end(self, code: int) -> ProcessEnd:
        if code > 128 and code - 128 in signals.valid_signals():
            signum = code - 128
            name = signals.Signals(signum).name
            error = f"killed by {name}"
            if signum == signals.SIGKILL and signum not in self._sent:
                error += (
                    ", not sent through the API: the sandbox's memory limit (which kills the "
                    "largest process when it is reached) or a signal from inside the sandbox"
                )
            return ProcessEnd(exit_code=None, signal=signum, error=error)
        return ProcessEnd(exit_code=code, error=f"exit status {code}" if code else None)

    # --- the connection
    def _close_connection(self) -> None:
        self._stdin_open = False
        with contextlib.suppress(Exception):
            self._writer.close()

    def discard_unstarted(self) -> None:
        """Give up on an exec the engine never started: only its connection is left."""
        self._close_connection()

    async def discard(self) -> None:
        """Give up on a process that did not start properly: kill it and close its connection."""
        self._close_connection()
        with contextlib.suppress(ProcessLookupError, OSError):
            await asyncio.get_running_loop().run_in_executor(
                SIGNALLERS,
                send_signal,
                self._api,
                self._container,
                self._user,
                signals.SIGKILL,
                self.pid or None,
                self._marker,
            )
