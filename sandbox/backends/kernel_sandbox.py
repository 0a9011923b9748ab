"""What local and Docker sandboxes share: the kernel driver, and a workspace kept on the host
(bound into the sandbox), whose files move through `Workspace` without following symlinks."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

from sandbox.backends.base import Sandbox
from sandbox.errors import SandboxError
from sandbox.kernel.collector import EventSink
from sandbox.kernel.driver import KernelDriver
from sandbox.models import Execution, FileInfo
from sandbox.spec import SandboxSpec
from sandbox.state_dir import SessionDirs
from sandbox.workspace_files import Entry, Workspace


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
        self.spec.env.update(env)  # the launcher reads it again for every new kernel
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

    async def upload(self, path: str, data: bytes) -> FileInfo:
        return _info(await asyncio.to_thread(self.workspace.write, path, data))

    async def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        return await asyncio.to_thread(self.workspace.read, path, max_bytes=max_bytes)

    async def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        entries = await asyncio.to_thread(self.workspace.list_dir, path, recursive=recursive)
        return [_info(e) for e in entries]

    async def remove_file(self, path: str) -> None:
        await asyncio.to_thread(self.workspace.remove, path)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.driver.close()
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        """Remove what the backend created for this sandbox beyond the kernel."""
        await asyncio.to_thread(self.dirs.remove)


def _info(entry: Entry) -> FileInfo:
    return FileInfo(
        path=entry.path,
        type=entry.kind,
        size=entry.size,
        modified_at=datetime.fromtimestamp(entry.mtime, UTC),
    )
