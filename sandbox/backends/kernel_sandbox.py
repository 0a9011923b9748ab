"""What local and Docker sandboxes share: kernel drivers, one per language, and a workspace kept
on the host (bound into the sandbox), whose files move through `Workspace` without following
symlinks.

Python's kernel starts with the sandbox; another language's starts the first time code in it
runs (a Python-only session pays nothing for the others), inside the same boundary, sharing the
workspace, and ends with the sandbox.

Workspace file work blocks (a big tree, a big file), so it runs on threads of its own, not on
the default pool every execution needs (keeping outputs, Docker calls), and each sandbox has at
most `FILE_OPERATIONS_PER_SANDBOX` in flight: one session cannot take every file worker, and
never any worker its own or another key's executions wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from code_interpreter_wire.errors import SandboxClosed, SandboxError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.results import EventSink, Execution, FileInfo
from code_interpreter_wire.spec import SandboxSpec, check_environment
from sandbox.backends.base import Sandbox
from sandbox.kernel.driver import KernelDriver
from sandbox.kernel.scopes import change_directory, set_env
from sandbox.languages import check_available
from sandbox.preload import PreloadFailed
from sandbox.state_dir import SessionDirs
from sandbox.workspace_files import Entry, Workspace

T = TypeVar("T")
FILE_OPERATIONS_PER_SANDBOX = 2
_FILE_WORKERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="workspace-files")


# The longest a preload may run: imports of a data stack on a loaded machine take seconds.
PRELOAD_TIMEOUT_S = 300.0


# Run after a preload: what its warm-up freed goes back to the system (glibc keeps freed heap
# for reuse otherwise; ~1 MiB a preloaded kernel, measured), so idle sessions hold less.
_GIVE_BACK = """\
try:
    import ctypes, gc
    gc.collect()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc's (musl has none)
        libc.malloc_trim(0)
except Exception:
    pass
"""


class KernelSandbox(Sandbox):
    """A sandbox whose code runs in Jupyter kernels driven by `KernelDriver`s."""

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        driver: KernelDriver,
        dirs: SessionDirs,
        workspace: Workspace,
        languages: list[str] | None = None,
        make_driver: Callable[[str], KernelDriver] | None = None,
    ) -> None:
        self.id = sandbox_id
        self.spec = spec
        self.driver = driver  # Python's
        self.dirs = dirs
        self.workspace = workspace
        self._languages = languages or [PYTHON]
        self._make_driver = make_driver
        self._drivers: dict[str, KernelDriver] = {PYTHON: driver}
        self._starting: dict[str, asyncio.Lock] = {}
        self._pending: dict[str, KernelDriver] = {}  # starting now: close() must stop them too
        self._closed = False
        self._file_slots = asyncio.Semaphore(FILE_OPERATIONS_PER_SANDBOX)
        driver.watch_processes(self._process_activity)

    def _process_activity(self) -> int | None:
        """What processes beside the kernels did (see `ProcessTable.activity`)."""
        return 0 if self._processes is None else self._processes.activity()

    async def preload(self, code: str, *, timeout_s: float = PRELOAD_TIMEOUT_S) -> None:
        """Run `code` in Python's kernel silently, in a namespace of its own: what it imports
        stays loaded; nothing of it is in the session's namespace, history or execution count
        (`In`, `Out`, `_` are untouched; the first cell is still 1)."""
        driver = await self._driver_for(PYTHON)
        wrapped = "".join(
            f"exec(compile({part!r}, '<preload>', 'exec'), {{}})\n" for part in (code, _GIVE_BACK)
        )
        done = await driver.execute(wrapped, timeout_s=timeout_s, silent=True)
        if done.error is not None:
            raise PreloadFailed(f"the preload failed: {done.error.value}")
        if not done.ok:
            raise SandboxError(f"the preload did not finish: {done.status.value}")

    async def _driver_for(self, language: str) -> KernelDriver:
        """The kernel of `language`, started now if this is its first use."""
        name = check_available(language, self.languages)
        driver = self._drivers.get(name)
        if driver is not None:
            return driver
        if self._make_driver is None:
            raise SandboxError(f"this sandbox cannot start a {name} kernel")
        async with self._starting.setdefault(name, asyncio.Lock()):
            if name in self._drivers:
                return self._drivers[name]
            if self._closed:
                raise SandboxClosed("the sandbox is closed")
            driver = self._make_driver(name)
            driver.watch_processes(self._process_activity)
            self._pending[name] = driver
            try:
                await driver.start()
            except BaseException:
                await driver.close()
                raise
            finally:
                self._pending.pop(name, None)
            if self._closed:  # closed while it started: it must not outlive the sandbox
                await driver.close()
                raise SandboxClosed("the sandbox was closed while its kernel started")
            self._drivers[name] = driver
            return driver

    @property
    def languages(self) -> list[str]:
        return list(self._languages)

    @property
    def started_languages(self) -> list[str]:
        return list(self._drivers)

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
        driver = await self._driver_for(language)
        return await driver.execute(
            code,
            timeout_s=timeout_s if timeout_s is not None else self.spec.default_timeout_s,
            env=env,
            cwd=cwd,
            on_event=on_event,
        )

    async def set_env(self, env: dict[str, str]) -> None:
        self.spec.env.update(check_environment(env))  # read again for every new kernel
        for language, driver in list(self._drivers.items()):
            execution = await driver.execute(set_env(language, env), timeout_s=30, silent=True)
            if not execution.ok:
                raise SandboxError(
                    f"could not set the environment of the {language} kernel: {execution.error}"
                )

    async def set_workdir(self, path: str) -> None:
        await super().set_workdir(path)
        for language, driver in list(self._drivers.items()):
            code = change_directory(language, self.spec.workdir)
            if code is None:
                continue
            execution = await driver.execute(code, timeout_s=30, silent=True)
            if not execution.ok:
                raise SandboxError(
                    f"could not move the {language} kernel to {path}: {execution.error}"
                )

    async def interrupt(self) -> bool:
        stopped = [await driver.interrupt() for driver in list(self._drivers.values())]
        return any(stopped)

    async def restart(self, language: str | None = None) -> None:
        if language is None:
            for driver in list(self._drivers.values()):
                await driver.restart()
            return
        name = check_available(language, self.languages)
        started = self._drivers.get(name)
        if started is None:
            await self._driver_for(name)  # not started yet: starting it is a fresh kernel
        else:
            await started.restart()

    @property
    def is_busy(self) -> bool:
        return any(driver.is_busy for driver in self._drivers.values())

    async def _file_work(self, work: Callable[..., T], *args: object, **kwargs: object) -> T:
        """Run blocking workspace work on the file workers, within this sandbox's share. The
        share is given back when the work ends, not when a caller gives up waiting for it."""
        await self._file_slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            done = _FILE_WORKERS.submit(functools.partial(work, *args, **kwargs))
        except BaseException:
            self._file_slots.release()
            raise
        done.add_done_callback(lambda _: _call_soon(loop, self._file_slots.release))
        return await asyncio.wrap_future(done)

    async def upload(self, path: str, data: bytes) -> FileInfo:
        return file_info(await self._file_work(self.workspace.write, path, data))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        return await self._file_work(self.workspace.read, path, max_bytes=max_bytes)

    async def export_file(self, path: str, dest: Path, *, max_bytes: int) -> int:
        def copy() -> int:
            with dest.open("wb") as sink:
                return self.workspace.copy_out(path, sink, max_bytes=max_bytes)

        return await self._file_work(copy)

    async def import_file(self, path: str, source: Path) -> FileInfo:
        def copy() -> Entry:
            with source.open("rb") as reader:
                return self.workspace.copy_in(path, reader)

        return file_info(await self._file_work(copy))

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        entries = await self._file_work(self.workspace.list_dir, path, recursive=recursive)
        return [file_info(e) for e in entries]

    async def remove_file(self, path: str) -> None:
        await self._file_work(self.workspace.remove, path)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._close_processes()
            # A kernel still starting is told (it stops waiting within half a second and kills
            # what it started); its start is waited for, so nothing of it outlives the sandbox.
            for starting in list(self._pending.values()):
                await starting.close()
            for lock in list(self._starting.values()):
                async with lock:
                    pass
            # Python's last: its kernel waits for the sandbox's cgroup to empty (local).
            for driver in reversed(list(self._drivers.values())):
                await driver.close()
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        """Remove what the backend created for this sandbox beyond the kernel."""
        await asyncio.to_thread(self.dirs.remove)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits for the share now
        loop.call_soon_threadsafe(callback)


def file_info(entry: Entry) -> FileInfo:
    """A workspace entry as the models say it."""
    return FileInfo(
        path=entry.path,
        type=entry.kind,
        size=entry.size,
        modified_at=datetime.fromtimestamp(entry.mtime, UTC),
        name_escaped=entry.name_escaped,
    )
