"""Processes in a Docker sandbox: each one an exec in the kernel's container, through the
engine's exec API.

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
- Signals are sent from inside the container by an exec of bash builtins (no fork, so it starts
  even while a fork bomb holds every pid), as the sandbox's uid: to the process's group, then to
  every process whose environment holds the process's own marker variable. Every descendant
  inherits that marker, so what escaped the group (setsid, double fork, a daemon) is signalled
  as well, and nothing else in the container is: not the kernel, not another process. Only a
  descendant that wiped its environment escapes the marker; it still dies with the container
  when the sandbox closes or its kernel is replaced. (The container's cgroup holds the kernel
  too, so it cannot tell a process's descendants apart; and a sweep from the host would need the
  orchestrator to be root in the engine's PID namespace, which a remote engine never gives.)
- Its end comes from `exec_inspect`: a death by signal N shows as 128+N (as in a shell).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import secrets
import signal as signals
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import docker
from docker.errors import APIError, DockerException, NotFound

from code_interpreter_wire.errors import (
    FileMissing,
    ProcessesUnsupported,
    ProcessStateError,
    SandboxError,
)
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox.backends.base import WORKSPACE_IN_SANDBOX
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
# $1 signal number, $2 process group (or empty), $3 marker (NAME=value). Builtins only: no fork.
_SIGNALLER = (
    '[ -z "$2" ] || kill -n "$1" -- "-$2" 2>/dev/null; '
    "for f in /proc/[0-9]*/environ; do "
    "p=${f#/proc/}; p=${p%/environ}; "
    "while IFS= read -r -d '' v; do "
    'if [[ $v == "$3" ]]; then kill -n "$1" "$p" 2>/dev/null; break; fi; '
    'done < "$f"; '
    "done 2>/dev/null; exit 0"
)
_SIGNAL_ATTEMPTS = 10
# Signalling runs an exec as the sandbox's user, which the sandbox can slow or stop: on threads
# of its own, few, so a sandbox can hold up only other signals, never the service's shared pool.
_SIGNALLERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="docker-signals")
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
            raise SandboxError(f"the engine could not start the process: {_reason(exc)}") from None
        try:
            connection, leftover = _take_connection(hijacked)
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
            tty=tty,
            stdin=request.stdin or tty,
            marker=marker,
        )
        if container_exited is not None:
            process.end_with(container_exited)
        try:
            await asyncio.wait_for(process.read_pid(), START_TIMEOUT_S)
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
            _send_signal, self._api, container, self._user, signals.SIGKILL, None, marker
        )
        loop = asyncio.get_running_loop()
        _abandoned.add(task := asyncio.ensure_future(loop.run_in_executor(_SIGNALLERS, kill)))
        task.add_done_callback(_forget)


# Kills of abandoned processes under way (kept referenced until they finish).
_abandoned: set[asyncio.Future[None]] = set()


def _forget(task: asyncio.Future[None]) -> None:
    _abandoned.discard(task)
    if not task.cancelled():
        task.exception()  # its container may be gone already: nothing is left to kill


def _send_signal(
    api: Any, container: str, user: str, signum: int, group: int | None, marker: str
) -> None:
    """Signal a process's group (if known) and everything holding its marker, from an exec in
    the container; retried, since a fork bomb may hold every pid for a moment."""
    # `timeout`: a signaller the sandbox stops or slows is killed, and its thread freed.
    command = [
        "timeout", "-s", "KILL", "20",
        "/bin/bash", "-c", _SIGNALLER, "signal", str(int(signum)), str(group or ""), marker,
    ]  # fmt: skip
    for attempt in range(_SIGNAL_ATTEMPTS):
        try:
            created = api.exec_create(container, command, stdout=True, stderr=True, user=user)
            api.exec_start(created["Id"])
            return
        except NotFound:
            raise ProcessLookupError("its container is gone") from None
        except (APIError, DockerException) as exc:
            if "is not running" in str(exc):
                raise ProcessLookupError("its container is not running") from None
            if attempt == _SIGNAL_ATTEMPTS - 1:
                raise OSError(f"could not signal the process: {_reason(exc)}") from None
            time.sleep(0.1 * (attempt + 1))


_KILLED_WITH_CONTAINER = ProcessEnd(
    exit_code=None,
    signal=int(signals.SIGKILL),
    error="killed with its container: the sandbox closed or its kernel was replaced",
)


class _DirectoryMissing(Exception):
    pass


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
            if piece is None:
                raise SandboxError(
                    "the process did not start: "
                    + (line.decode(errors="replace").strip() or "the engine ended its stream")
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
            _send_signal, self._api, self._container, self._user, signum, self.pid, self._marker
        )
        try:
            await asyncio.get_running_loop().run_in_executor(_SIGNALLERS, send)
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
            raise SandboxError(f"could not resize the terminal: {_reason(exc)}") from None

    async def wait(self) -> ProcessEnd:
        """Its end from the engine, once the exec no longer runs (output can end before)."""
        delay = 0.02
        while True:
            try:
                state = await asyncio.to_thread(self._api.exec_inspect, self._exec_id)
            except NotFound:  # removed with force, which kills everything in it
                return _KILLED_WITH_CONTAINER
            except (APIError, DockerException) as exc:
                return ProcessEnd(exit_code=None, error=f"the engine lost it: {_reason(exc)}")
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

    async def discard(self) -> None:
        """Give up on a process that did not start properly: kill it and close its connection."""
        self._close_connection()
        with contextlib.suppress(ProcessLookupError, OSError):
            await asyncio.to_thread(
                _send_signal,
                self._api,
                self._container,
                self._user,
                signals.SIGKILL,
                self.pid or None,
                self._marker,
            )


def _take_connection(hijacked: Any) -> tuple[socket.socket, bytes]:
    """A socket of our own for the exec's connection, and the bytes docker-py read past its
    HTTP headers. docker-py's response is closed: from here on the connection is ours alone."""
    raw = getattr(hijacked, "_sock", hijacked)
    if not isinstance(raw, socket.socket) or type(raw) is not socket.socket:
        with contextlib.suppress(Exception):
            hijacked.close()
        raise ProcessesUnsupported(
            "processes need a plain unix or tcp connection to the Docker engine (not TLS, ssh or "
            "a named pipe)"
        )
    connection = raw.dup()
    connection.setblocking(False)  # shared with `raw`: the peek below never blocks
    leftover = b""
    response = getattr(hijacked, "_response", None)
    buffered = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
    if isinstance(buffered, io.BufferedReader):
        with contextlib.suppress(OSError, ValueError):
            leftover = buffered.peek() or b""
    with contextlib.suppress(Exception):
        if response is not None:
            response.close()
    with contextlib.suppress(Exception):
        hijacked.close()
    with contextlib.suppress(Exception):
        raw.close()
    return connection, leftover


def _reason(exc: Exception) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)
