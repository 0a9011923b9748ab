"""One E2B sandbox, driven through the `e2b-code-interpreter` SDK (the backend that makes and
wakes them: e2b_cloud.py).

E2B runs its own Jupyter server in each VM, so this sandbox sits on the interface's "execute
code" level: E2B's results, logs and errors are fed through the same `OutputCollector` as our own
kernels' messages, so limits, events and the `Execution` come out exactly as for local and Docker.

What E2B cannot do is said where it matters: it interrupts code only when the caller of
`/execute` goes away, so a time limit or `interrupt()` closes that request; per-call `cwd` costs
two extra executions (E2B has no such option); resource limits come from the E2B template.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any, Literal

import httpx
from e2b import (
    AuthenticationException,
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    RateLimitException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b_code_interpreter import AsyncSandbox

from code_interpreter_wire.errors import (
    BackendRateLimited,
    BackendTimeout,
    FileAccessError,
    FileMissing,
    FileTooLarge,
    SandboxClosed,
    SandboxError,
    SandboxStartError,
    ScopeRefused,
)
from code_interpreter_wire.languages import LANGUAGES, PYTHON
from code_interpreter_wire.results import (
    EventSink,
    Execution,
    ExecutionError,
    ExecutionStatus,
    FileInfo,
)
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Sandbox
from sandbox.backends.e2b_cloud_processes import E2BSpawner
from sandbox.kernel.collector import OutputCollector
from sandbox.languages import check_available
from sandbox.processes.spawned import Spawner
from sandbox.workspace_files import clean_path

log = logging.getLogger(__name__)
# E2B's home directory, where relative paths land when the sandbox does not say otherwise.
E2B_HOME = "/home/user"
# E2B result fields and the MIME types they came from, to rebuild the kernel's bundle.
_RESULT_MIME = {
    "text": "text/plain",
    "html": "text/html",
    "markdown": "text/markdown",
    "latex": "text/latex",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "svg": "image/svg+xml",
    "pdf": "application/pdf",
    "json": "application/json",
    "javascript": "application/javascript",
}
_FILE_TYPES: dict[FileType, Literal["file", "directory", "symlink", "other"]] = {
    FileType.FILE: "file",
    FileType.DIR: "directory",
    FileType.SYMLINK: "symlink",
}


async def working_directory(remote: AsyncSandbox) -> str:
    """Where the default Python context runs: the workspace root for relative paths."""
    try:
        contexts = await remote.list_code_contexts()
    except Exception as exc:
        raise SandboxStartError(
            f"the E2B sandbox's code interpreter did not answer: {exc}"
        ) from exc
    cwds = [c.cwd for c in contexts if c.language == "python" and c.cwd]
    cwd = str(cwds[0]) if cwds else E2B_HOME
    # Spelled as the file API names its entries (a server whose home is a link to its
    # workspace names the workspace), so that listed paths are found under it.
    with contextlib.suppress(Exception):
        cwd = (await remote.files.get_info(cwd)).path or cwd
    return cwd


class _Run:
    """The execution in progress, so `interrupt()` can end it."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()


class E2BSandbox(Sandbox):
    """One E2B sandbox; code runs in its default context of each language."""

    backend = "e2b"

    @property
    def languages(self) -> list[str]:
        return list(LANGUAGES)  # E2B's code-interpreter template runs every one of them

    def __init__(
        self, remote: AsyncSandbox, spec: SandboxSpec, workdir: str, *, sandbox_timeout_s: int
    ) -> None:
        self.id = str(remote.sandbox_id)
        self.spec = spec
        self.remote = remote
        self.sandbox_timeout_s = sandbox_timeout_s  # E2B ends it then, unless extended
        self.workdir = PurePosixPath(workdir)
        self._env: dict[str, str] = {}
        self._lock = asyncio.Lock()  # FIFO: queued executions run in the order they came
        self._run: _Run | None = None
        self._closed = False
        self._extended_at = time.monotonic()

    # ----------------------------------------------------------------------------------------
    # Execution

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
        self._check_open()
        language = check_available(language, self.languages)
        if cwd is not None and PurePosixPath(cwd) in (self.workdir, PurePosixPath(E2B_HOME)):
            cwd = None  # where E2B's kernels run already
        if cwd is not None and language != PYTHON:
            raise ScopeRefused(
                "a per-call working directory on the E2B backend works in Python only; "
                "change directory in the code itself"
            )
        async with self._lock:
            self._check_open()
            started = time.monotonic()
            limit = timeout_s if timeout_s is not None else self.spec.default_timeout_s
            collector = OutputCollector(
                self.spec.output_limit_chars,
                on_event,
                result_limit_bytes=self.spec.result_limit_bytes,
                result_limit_count=self.spec.result_limit_count,
            )
            envs = {**self._env, **(env or {})}
            if cwd is not None:  # E2B has no per-call cwd: change it around the call
                setup = (
                    "import os as _o; _cir_cwd = _o.getcwd(); "
                    f"_o.chdir(_o.path.join(_cir_cwd, {cwd!r})); del _o"
                )
                status = await self._run_code(setup, limit, envs, collector, PYTHON)
                if status is not ExecutionStatus.OK:
                    return collector.build(status=status, duration_s=time.monotonic() - started)
            try:
                status = await self._run_code(code, limit, envs, collector, language)
            finally:
                if cwd is not None:
                    restore = "import os as _o; _o.chdir(_cir_cwd); del _o, _cir_cwd"
                    with contextlib.suppress(Exception):
                        await self._run_code(restore, 30.0, {}, OutputCollector(1000, None), PYTHON)
            await self._extend_if_due()
            return collector.build(status=status, duration_s=time.monotonic() - started)

    async def _run_code(
        self,
        code: str,
        timeout_s: float,
        envs: dict[str, str],
        collector: OutputCollector,
        language: str,
    ) -> ExecutionStatus:
        """Run one cell, feeding its outputs to `collector`; end it at the limit or on request."""
        run = self._run = _Run()

        async def on_stdout(message: Any) -> None:
            await collector.handle(_message("stream", name="stdout", text=message.line))

        async def on_stderr(message: Any) -> None:
            await collector.handle(_message("stream", name="stderr", text=message.line))

        async def on_result(result: Any) -> None:
            kind = "execute_result" if result.is_main_result else "display_data"
            await collector.handle(_message(kind, data=_bundle(result)))

        async def on_error(error: Any) -> None:
            await collector.handle(
                _message("error", ename=error.name, evalue=error.value, traceback=[error.traceback])
            )

        request = asyncio.ensure_future(
            self.remote.run_code(
                code,
                language=language,  # E2B's server knows our canonical names
                envs=envs or None,
                timeout=0,  # no deadline in the SDK: ours, below, closes the request instead
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                on_result=on_result,
                on_error=on_error,
            )
        )
        stopped = asyncio.ensure_future(run.stop.wait())
        try:
            done, _ = await asyncio.wait(
                {request, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if request in done:
                try:
                    execution = request.result()
                except Exception as exc:
                    raise await self._failure(exc) from exc
                if collector.execution_count is None:
                    collector.execution_count = execution.execution_count
                return ExecutionStatus.ERROR if collector.error else ExecutionStatus.OK
            # Closing the request is how E2B is told to interrupt the kernel.
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
            cancelled = stopped in done
            message = (
                "The execution was interrupted on request"
                if cancelled
                else f"The execution ran past its {timeout_s:g} s time limit and was interrupted"
            )
            await collector.emit_error(
                ExecutionError(
                    name="Cancelled" if cancelled else "ExecutionTimeout",
                    value=f"{message}; the kernel's state is kept.",
                )
            )
            return ExecutionStatus.CANCELLED if cancelled else ExecutionStatus.TIMEOUT
        finally:
            stopped.cancel()
            if not request.done():  # our caller went away: stop the code too
                request.cancel()
            self._run = None

    async def _extend_if_due(self) -> None:
        """Keep E2B from killing a sandbox in use: extend its timeout at half-life."""
        if time.monotonic() - self._extended_at < self.sandbox_timeout_s / 2:
            return
        try:
            await self.remote.set_timeout(self.sandbox_timeout_s)
            self._extended_at = time.monotonic()
        except Exception:  # the execution is done and is returned; the next call retries
            log.warning("extending the timeout of E2B sandbox %s failed", self.id, exc_info=True)

    # ----------------------------------------------------------------------------------------
    # Control

    async def set_env(self, env: dict[str, str]) -> None:
        # E2B cannot change a running kernel's environment, but sets per-execution variables:
        # these go with every execution from now on.
        self._env.update(env)

    async def interrupt(self) -> bool:
        run = self._run
        if run is None:
            return False
        run.stop.set()
        return True

    async def restart(self, language: str | None = None) -> None:
        self._check_open()
        wanted = None if language is None else check_available(language, self.languages)
        if self._run is not None:
            self._run.stop.set()
        async with self._lock:
            try:
                contexts = await self.remote.list_code_contexts()
                for context in contexts:
                    if wanted is None or context.language == wanted:
                        await self.remote.restart_code_context(context)
            except Exception as exc:
                raise await self._failure(exc) from exc

    @property
    def is_busy(self) -> bool:
        return self._lock.locked()

    def spawner(self) -> Spawner:
        """E2B's own commands and terminals, beside its kernel (e2b_cloud_processes.py)."""
        self._check_open()
        return E2BSpawner(self.remote, str(self.workdir), self._env)

    async def suspend(self) -> str | None:
        """E2B's own pause: memory, processes and files kept at E2B; `E2BBackend.wake` resumes.
        None if it could not pause (the caller then saves the kernel's state itself)."""
        self._check_open()
        if self._run is not None:
            return None  # running code: nothing is paused mid-execution
        try:
            await self._close_processes()
            await self.remote.pause()
        except Exception:
            log.warning("E2B could not pause sandbox %s", self.id, exc_info=True)
            return None
        self._closed = True
        return self.id

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._run is not None:
            self._run.stop.set()
        with contextlib.suppress(Exception):
            await self._close_processes()
        with contextlib.suppress(Exception):
            await self.remote.kill()

    # ----------------------------------------------------------------------------------------
    # Files: workspace paths are relative to the default context's working directory.

    def _remote_path(self, path: str, *, allow_root: bool = False) -> str:
        return str(self.workdir.joinpath(*clean_path(path, allow_root=allow_root)))

    async def upload(self, path: str, data: bytes) -> FileInfo:
        self._check_open()
        target = self._remote_path(path)
        try:
            await self.remote.files.write(target, data)
        except Exception as exc:
            raise await self._failure(exc) from exc
        return FileInfo(
            path="/".join(clean_path(path)),
            type="file",
            size=len(data),
            modified_at=datetime.now(UTC),
        )

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        self._check_open()
        target = self._remote_path(path)
        chunks: list[bytes] = []
        size = 0
        try:
            reader = await self.remote.files.read(target, format="stream")
            async with reader:
                async for chunk in reader:
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(f"{path!r} is larger than {max_bytes} bytes")
                    chunks.append(bytes(chunk))
        except FileTooLarge:
            raise
        except Exception as exc:
            raise await self._failure(exc) from exc
        return b"".join(chunks)

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        self._check_open()
        target = self._remote_path(path, allow_root=True)
        try:
            entries = await self.remote.files.list(target, depth=64 if recursive else 1)
        except Exception as exc:
            raise await self._failure(exc) from exc
        out: list[FileInfo] = []
        for entry in entries:
            try:
                relative = PurePosixPath(entry.path).relative_to(self.workdir)
            except ValueError:
                continue
            modified = entry.modified_time
            out.append(
                FileInfo(
                    path=str(relative),
                    type=_FILE_TYPES.get(entry.type, "other"),
                    size=entry.size,
                    modified_at=modified if modified.tzinfo else modified.replace(tzinfo=UTC),
                )
            )
        return sorted(out, key=lambda f: f.path)

    async def remove_file(self, path: str) -> None:
        self._check_open()
        target = self._remote_path(path)
        try:
            await self.remote.files.remove(target)
        except Exception as exc:
            raise await self._failure(exc) from exc

    # ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox is closed")

    async def _failure(self, exc: Exception) -> SandboxError:
        """Our typed error for what the SDK raised."""
        if isinstance(exc, SandboxError):
            return exc
        if isinstance(exc, FileNotFoundException):
            return FileMissing(str(exc))
        if isinstance(exc, InvalidArgumentException):
            return FileAccessError(str(exc))
        if isinstance(exc, RateLimitException):
            return BackendRateLimited(f"E2B is rate-limiting this service: {exc}")
        if isinstance(exc, SandboxNotFoundException | SandboxNotRunningException):
            return SandboxClosed(f"the E2B sandbox is gone: {exc}")
        if isinstance(exc, NotFoundException | TimeoutException | httpx.TransportError):
            if await self._gone():
                return SandboxClosed(f"the E2B sandbox is gone (killed or timed out): {exc}")
            if isinstance(exc, TimeoutException | httpx.TimeoutException):
                return BackendTimeout(f"E2B did not answer in time: {exc}")
        if isinstance(exc, AuthenticationException):
            return SandboxError(f"E2B refused the credentials: {exc}")
        return SandboxError(f"E2B failed: {type(exc).__name__}: {exc}")

    async def _gone(self) -> bool:
        """Whether the sandbox is known to be gone (a failed probe proves nothing)."""
        try:
            return not await self.remote.is_running(request_timeout=10)
        except Exception:
            return False


def _message(kind: str, **content: Any) -> dict[str, Any]:
    """An iopub-shaped message, which is what `OutputCollector` takes."""
    return {"header": {"msg_type": kind}, "content": content}


def _bundle(result: Any) -> dict[str, Any]:
    """The MIME bundle an E2B `Result` was made from."""
    bundle: dict[str, Any] = {}
    for field, mime in _RESULT_MIME.items():
        value = getattr(result, field, None)
        if value is not None:
            bundle[mime] = value
    # E2B's own chart and column data, as its kernel sent them (code_interpreter_wire/results.py
    # lifts them).
    if getattr(result, "data", None):
        bundle["e2b/data"] = result.data
    chart = getattr(result, "chart", None)
    if chart is not None and hasattr(chart, "to_dict"):
        bundle["e2b/chart"] = chart.to_dict()
    bundle.update(result.extra or {})
    return bundle
