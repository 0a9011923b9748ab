"""A blocking facade over the async API, for scripts and notebooks.

Every synchronous sandbox of the process lives on the shared loop of
`code_interpreter_wire.background_loop`; each call hands its coroutine to that loop and waits for
the answer.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

from code_interpreter_wire.background_loop import run_sync
from code_interpreter_wire.results import Execution, FileInfo
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, Sandbox
from sandbox.backends.registry import create_backend


class SyncSandbox:
    """`with SyncSandbox.create() as sb: print(sb.execute("1 + 1").text)`"""

    def __init__(self, sandbox: Sandbox, backend: Backend | None = None) -> None:
        self.sandbox = sandbox
        self._backend = backend

    @classmethod
    def create(
        cls, backend: str = "local", spec: SandboxSpec | None = None, **config: Any
    ) -> SyncSandbox:
        owned = create_backend(backend, **config)
        return cls(run_sync(owned.create(spec)), owned)

    @property
    def id(self) -> str:
        return self.sandbox.id

    def execute(
        self,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> Execution:
        return run_sync(self.sandbox.execute(code, timeout_s=timeout_s, env=env, cwd=cwd))

    def interrupt(self) -> bool:
        return run_sync(self.sandbox.interrupt())

    def restart(self) -> None:
        run_sync(self.sandbox.restart())

    def upload(self, path: str, data: bytes) -> FileInfo:
        return run_sync(self.sandbox.upload(path, data))

    def download(self, path: str, *, max_bytes: int = 100 << 20) -> bytes:
        return run_sync(self.sandbox.download(path, max_bytes=max_bytes))

    def list_files(self, path: str = "", *, recursive: bool = False) -> list[FileInfo]:
        return run_sync(self.sandbox.list_files(path, recursive=recursive))

    def remove_file(self, path: str) -> None:
        run_sync(self.sandbox.remove_file(path))

    def close(self) -> None:
        run_sync(self.sandbox.close())
        if self._backend is not None:
            run_sync(self._backend.close())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
