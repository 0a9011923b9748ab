"""Processes in an E2B sandbox: E2B's own commands and terminals (its envd process service).

They run in E2B's microVM beside its kernel, as E2B runs them: through `bash -l -c` (an argv is
quoted into one command line), as E2B's default user, in the sandbox's working directory. The
output arrives through the SDK's callbacks and is handed on as it comes; the SDK keeps none of
it (`retain_output=False`), and a slow reader here slows the stream rather than growing a queue.
E2B signals a process itself only with SIGKILL or SIGTERM-like kills; any other signal is sent
with `kill` from inside the sandbox, to the process's group.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import shlex
import signal as signals
from collections.abc import AsyncIterator
from typing import Any

from e2b import CommandExitException, PtySize
from e2b_code_interpreter import AsyncSandbox

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.processes import ProcessEnd, ProcessRequest, Stream, TerminalSize
from sandbox.processes.spawned import SpawnedProcess, Spawner

_QUEUED_CHUNKS = 64  # chunks waiting to be read before the SDK's reader waits


class E2BSpawner(Spawner):
    def __init__(self, remote: AsyncSandbox, workdir: str, env: dict[str, str]) -> None:
        self.remote = remote
        self.workdir = workdir
        self.env = env  # the session's variables (set_env), given to every process

    async def spawn(self, request: ProcessRequest) -> SpawnedProcess:
        process = _E2BProcess(self.remote)
        cwd = posixpath.join(self.workdir, request.cwd) if request.cwd else self.workdir
        envs = {**self.env, **request.env}
        try:
            if request.terminal is not None:
                size = PtySize(rows=request.terminal.rows, cols=request.terminal.cols)
                handle = await self.remote.pty.create(
                    size, on_data=process.on_terminal, cwd=cwd, envs=envs, timeout=0
                )
                if request.argv is not None or request.command is not None:
                    command = request.command or shlex.join(request.argv or [])
                    await self.remote.pty.send_stdin(handle.pid, f"exec {command}\n".encode())
            else:
                command = request.command or shlex.join(request.argv or [])
                handle = await self.remote.commands.run(
                    command,
                    background=True,
                    envs=envs,
                    cwd=cwd,
                    stdin=request.stdin,
                    on_stdout=process.on_stdout,
                    on_stderr=process.on_stderr,
                    timeout=0,  # the time limit is kept here, by killing it
                    retain_output=False,
                )
        except Exception as exc:
            raise SandboxError(f"E2B could not start the process: {exc}") from exc
        process.attach(handle, terminal=request.terminal is not None)
        return process


class _E2BProcess(SpawnedProcess):
    def __init__(self, remote: AsyncSandbox) -> None:
        self.remote = remote
        self.pid = 0
        self._handle: Any = None
        self._terminal = False
        self._chunks: asyncio.Queue[tuple[Stream, bytes] | None] = asyncio.Queue(_QUEUED_CHUNKS)
        self._ended: asyncio.Future[ProcessEnd] = asyncio.get_running_loop().create_future()
        self._signalled: int | None = None
        self._waiter: asyncio.Task[None] | None = None

    def attach(self, handle: Any, *, terminal: bool) -> None:
        self._handle = handle
        self._terminal = terminal
        self.pid = int(handle.pid)
        self._waiter = asyncio.ensure_future(self._wait_for_end())

    async def on_stdout(self, text: str) -> None:
        await self._chunks.put(("stdout", text.encode()))

    async def on_stderr(self, text: str) -> None:
        await self._chunks.put(("stderr", text.encode()))

    async def on_terminal(self, data: bytes) -> None:
        await self._chunks.put(("pty", bytes(data)))

    async def _wait_for_end(self) -> None:
        try:
            result = await self._handle.wait()
            end = ProcessEnd(exit_code=int(result.exit_code))
        except CommandExitException as exc:
            code = int(exc.exit_code)
            if code < 0:  # E2B says -1 for a process a signal ended
                signum = self._signalled or signals.SIGKILL
                end = ProcessEnd(exit_code=None, signal=signum, error=str(exc.error or exc))
            else:
                end = ProcessEnd(exit_code=code, error=str(exc.error or "") or None)
        except Exception as exc:
            end = ProcessEnd(exit_code=None, error=f"E2B lost the process: {exc}")
        await self._chunks.put(None)
        self._ended.set_result(end)

    async def output(self) -> AsyncIterator[tuple[Stream, bytes]]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk

    async def write_stdin(self, data: bytes) -> None:
        if self._terminal:
            await self.remote.pty.send_stdin(self.pid, data)
        else:
            await self.remote.commands.send_stdin(self.pid, data)

    async def close_stdin(self) -> None:
        if self._terminal:
            await self.write_stdin(b"\x04")  # a terminal's EOF is Ctrl-D
        else:
            await self.remote.commands.close_stdin(self.pid)

    async def signal(self, signum: int) -> None:
        self._signalled = signum
        if signum == signals.SIGKILL:
            await self.remote.commands.kill(self.pid)
            return
        # Other signals: from inside, to the process's group (its children with it).
        with contextlib.suppress(CommandExitException):  # it had ended: nothing to signal
            await self.remote.commands.run(
                f"kill -{int(signum)} -- -{self.pid} 2>/dev/null || kill -{int(signum)} {self.pid}",
                timeout=30,
            )

    async def resize(self, size: TerminalSize) -> None:
        await self.remote.pty.resize(self.pid, PtySize(rows=size.rows, cols=size.cols))

    async def wait(self) -> ProcessEnd:
        return await asyncio.shield(self._ended)

    async def disconnect(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._waiter
