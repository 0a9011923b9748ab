"""A blocking facade over the async API, for scripts and notebooks.

One background thread runs an event loop for every synchronous sandbox of the process; each call
hands its coroutine to that loop and waits for the answer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

from sandbox.backends.base import Backend, Sandbox
from sandbox.models import Execution, FileInfo
from sandbox.registry import create_backend
from sandbox.spec import SandboxSpec

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="sandbox-loop", daemon=True).start()
    return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on the shared background loop and wait for its result."""
    return asyncio.run_coroutine_threadsafe(coro, _background_loop()).result()


async def run_in_background(coro: Coroutine[Any, Any, T]) -> T:
    """Await a coroutine that runs on the shared background loop.

    Sandboxes are bound to the loop that made them; running every call of a shared object there
    lets sync and async callers on any loop (a framework's, a thread's) use it alike.
    """
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _background_loop()))


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
