"""A session's sandbox as the service holds it in cluster mode: every call forwarded, and a
`SandboxLost` (its node died) turned into the end of the session, answered `SessionLost`.

One place for it, rather than a try in each of the service's calls: whichever call first finds
the sandbox gone ends the session (once across replicas: the manager claims the end) and says
why; never a silent fresh kernel. The process handles it returns are guarded the same way (a
wait on a process whose node died ends the session too). Only a loss ends it: a sandbox out of
reach for now (`BackendUnavailable`, 503) passes through and the session stays.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from sandbox.backends.base import Sandbox
from sandbox.errors import SandboxLost
from sandbox.languages import PYTHON
from sandbox.models import EventSink, Execution, FileInfo, OutputEvent
from sandbox.processes.handle import ProcessHandle
from sandbox.processes.managed import KILL_GRACE_S, ManagedProcess, ProcessEvent
from sandbox.processes.models import CommandResult, ProcessInfo, ProcessRequest, TerminalSize

P = ParamSpec("P")
T = TypeVar("T")

# Told the loss; returns the error to raise (SessionLost, or SessionExpired if it had ended).
OnLost = Callable[[SandboxLost], Awaitable[Exception]]


class LostGuard(Sandbox):
    def __init__(self, inner: Sandbox, on_lost: OnLost) -> None:
        self.inner = inner
        self._on_lost = on_lost
        self.id = inner.id
        self.backend = inner.backend
        self.spec = inner.spec
        self.runtime = inner.runtime
        self.host_channel = inner.host_channel
        self.egress_channel = inner.egress_channel

    async def _call(self, call: Callable[P, Awaitable[T]], *args: P.args, **kw: P.kwargs) -> T:
        try:
            return await call(*args, **kw)
        except SandboxLost as exc:
            raise await self._on_lost(exc) from None

    @property
    def handle(self) -> str | None:
        return self.inner.handle

    @property
    def languages(self) -> list[str]:
        return self.inner.languages

    @property
    def started_languages(self) -> list[str]:
        started = getattr(self.inner, "started_languages", None)
        return list(started) if started is not None else [PYTHON]

    @property
    def is_busy(self) -> bool:
        return self.inner.is_busy

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
        language: str = PYTHON,
    ) -> Execution:
        return await self._call(
            self.inner.execute,
            code,
            timeout_s=timeout_s,
            env=env,
            cwd=cwd,
            on_event=on_event,
            language=language,
        )

    async def stream(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        language: str = PYTHON,
    ) -> AsyncIterator[OutputEvent]:
        try:
            async for event in self.inner.stream(
                code, timeout_s=timeout_s, env=env, cwd=cwd, language=language
            ):
                yield event
        except SandboxLost as exc:
            raise await self._on_lost(exc) from None

    async def set_env(self, env: dict[str, str]) -> None:
        await self._call(self.inner.set_env, env)

    async def set_workdir(self, path: str) -> None:
        await self._call(self.inner.set_workdir, path)

    async def interrupt(self) -> bool:
        return await self._call(self.inner.interrupt)

    async def restart(self, language: str | None = None) -> None:
        await self._call(self.inner.restart, language)

    async def upload(self, path: str, data: bytes) -> FileInfo:
        return await self._call(self.inner.upload, path, data)

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        return await self._call(self.inner.download, path, max_bytes=max_bytes)

    async def export_file(self, path: str, dest: Path, *, max_bytes: int) -> int:
        return await self._call(self.inner.export_file, path, dest, max_bytes=max_bytes)

    async def import_file(self, path: str, source: Path) -> FileInfo:
        return await self._call(self.inner.import_file, path, source)

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        return await self._call(self.inner.list_files, path, recursive=recursive)

    async def remove_file(self, path: str) -> None:
        await self._call(self.inner.remove_file, path)

    async def touch(self) -> None:
        """A keepalive, for a sandbox that counts its own activity for every replica (a no-op
        for one that does not)."""
        touch: Callable[[], Awaitable[None]] | None = getattr(self.inner, "touch", None)
        if touch is not None:
            await self._call(touch)

    async def close(self) -> None:
        """Closing a lost sandbox is done already: nothing to tell."""
        with contextlib.suppress(SandboxLost):
            await self.inner.close()

    async def suspend(self) -> str | None:
        return await self._call(self.inner.suspend)

    async def start_process(self, request: ProcessRequest) -> ProcessHandle:
        handle = await self._call(self.inner.start_process, request)
        return GuardedProcess(handle, self._on_lost)

    async def run_command(self, request: ProcessRequest) -> CommandResult:
        return await self._call(self.inner.run_command, request)

    def process(self, pid: int) -> ManagedProcess:
        return self.inner.process(pid)

    def list_processes(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        return self.inner.list_processes(include_ended=include_ended)

    async def get_process(self, pid: int) -> ProcessHandle:
        return GuardedProcess(await self._call(self.inner.get_process, pid), self._on_lost)

    async def processes(self, *, include_ended: bool = False) -> list[ProcessInfo]:
        return await self._call(self.inner.processes, include_ended=include_ended)


class GuardedProcess:
    """A process handle of a guarded sandbox: a `SandboxLost` from any of its calls ends the
    session, as one from the sandbox's own calls does."""

    def __init__(self, inner: ProcessHandle, on_lost: OnLost) -> None:
        self.inner = inner
        self._on_lost = on_lost

    async def _call(self, call: Callable[P, Awaitable[T]], *args: P.args, **kw: P.kwargs) -> T:
        try:
            return await call(*args, **kw)
        except SandboxLost as exc:
            raise await self._on_lost(exc) from None

    @property
    def pid(self) -> int:
        return self.inner.pid

    def info(self) -> ProcessInfo:
        return self.inner.info()

    def events(self, *, replay: bool = False) -> AsyncIterator[ProcessEvent]:
        return self._events(replay)

    async def _events(self, replay: bool) -> AsyncIterator[ProcessEvent]:
        events: AsyncIterator[ProcessEvent] | None = None
        try:
            events = self.inner.events(replay=replay)
            async for event in events:
                yield event
        except SandboxLost as exc:
            raise await self._on_lost(exc) from None
        finally:  # a reader that left stops the inner stream (its listener) now
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def wait(self) -> CommandResult:
        return await self._call(self.inner.wait)

    async def write_stdin(self, data: bytes) -> None:
        await self._call(self.inner.write_stdin, data)

    async def close_stdin(self) -> None:
        await self._call(self.inner.close_stdin)

    async def signal(self, signum: int) -> None:
        await self._call(self.inner.signal, signum)

    async def resize(self, size: TerminalSize) -> None:
        await self._call(self.inner.resize, size)

    async def kill(self, grace_s: float = KILL_GRACE_S) -> None:
        await self._call(self.inner.kill, grace_s)
