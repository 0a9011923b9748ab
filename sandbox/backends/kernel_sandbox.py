"""What local and Docker sandboxes share: the kernel driver, and a workspace kept on the host
(bound into the sandbox), whose files move through `Workspace` without following symlinks.

Workspace file work blocks (a big tree, a big file), so it runs on threads of its own, not on
the default pool every execution needs (keeping outputs, Docker calls), and each sandbox has at
most `FILE_OPERATIONS_PER_SANDBOX` in flight: one session cannot take every file worker, and
never any worker its own or another key's executions wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TypeVar

from sandbox.backends.base import Sandbox
from sandbox.errors import SandboxError
from sandbox.kernel.driver import KernelDriver
from sandbox.models import EventSink, Execution, FileInfo
from sandbox.spec import SandboxSpec, check_environment
from sandbox.state_dir import SessionDirs
from sandbox.workspace_files import Entry, Workspace

T = TypeVar("T")
FILE_OPERATIONS_PER_SANDBOX = 2
_FILE_WORKERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="workspace-files")


class KernelSandbox(Sandbox):
    """A sandbox whose code runs in an ipykernel driven by `KernelDriver`."""

    def __init__(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        driver: KernelDriver,
        dirs: SessionDirs,
        workspace: Workspace,
    ) -> None:
        self.id = sandbox_id
        self.spec = spec
        self.driver = driver
        self.dirs = dirs
        self.workspace = workspace
        self._closed = False
        self._file_slots = asyncio.Semaphore(FILE_OPERATIONS_PER_SANDBOX)

    async def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
    ) -> Execution:
        return await self.driver.execute(
            code,
            timeout_s=timeout_s if timeout_s is not None else self.spec.default_timeout_s,
            env=env,
            cwd=cwd,
            on_event=on_event,
        )

    async def set_env(self, env: dict[str, str]) -> None:
        self.spec.env.update(check_environment(env))  # read again for every new kernel
        code = f"import os as _o; _o.environ.update({json.dumps(env)}); del _o"
        execution = await self.driver.execute(code, timeout_s=30, silent=True)
        if not execution.ok:
            raise SandboxError(f"could not set the environment: {execution.error}")

    async def interrupt(self) -> bool:
        return await self.driver.interrupt()

    async def restart(self) -> None:
        await self.driver.restart()

    @property
    def is_busy(self) -> bool:
        return self.driver.is_busy

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
        return _info(await self._file_work(self.workspace.write, path, data))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        return await self._file_work(self.workspace.read, path, max_bytes=max_bytes)

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        entries = await self._file_work(self.workspace.list_dir, path, recursive=recursive)
        return [_info(e) for e in entries]

    async def remove_file(self, path: str) -> None:
        await self._file_work(self.workspace.remove, path)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._close_processes()
            await self.driver.close()
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        """Remove what the backend created for this sandbox beyond the kernel."""
        await asyncio.to_thread(self.dirs.remove)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits for the share now
        loop.call_soon_threadsafe(callback)


def _info(entry: Entry) -> FileInfo:
    return FileInfo(
        path=entry.path,
        type=entry.kind,
        size=entry.size,
        modified_at=datetime.fromtimestamp(entry.mtime, UTC),
        name_escaped=entry.name_escaped,
    )
