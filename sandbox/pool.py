"""Warm pools: sandboxes started ahead of demand, so creating a session is a hand-over.

A pool holds up to `size` ready sandboxes of one backend and one spec. Taking one hands it over
at once and starts a replacement in the background. A sandbox leaves the pool once and is never
put back: sessions never share a sandbox. A pool with a preload runs it in each sandbox before
the sandbox counts as ready (`Sandbox.preload`: modules imported, caches warmed, nothing of it
visible to the session's code), so the first cell of a session pays for none of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, Sandbox

log = logging.getLogger(__name__)


class WarmPool:
    def __init__(
        self, backend: Backend, spec: SandboxSpec, size: int, *, preload: str = ""
    ) -> None:
        self.backend = backend
        self.preload = preload
        self.spec = spec
        self.size = size
        self._ready: deque[Sandbox] = deque()
        self._starting = 0
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.failures = 0

    @property
    def ready(self) -> int:
        return len(self._ready)

    def fits(self, spec: SandboxSpec) -> bool:
        """Whether a request for `spec` can be served from this pool."""
        return self.size > 0 and spec == self.spec

    def fill(self) -> None:
        """Start as many sandboxes as the pool lacks, in the background."""
        while not self._closed and len(self._ready) + self._starting < self.size:
            self._starting += 1
            task = asyncio.ensure_future(self._start_one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start_one(self) -> None:
        try:
            sandbox = await self._ready_sandbox()
        except Exception:
            self.failures += 1
            log.exception("the %s pool could not start a sandbox", self.backend.name)
            await asyncio.sleep(min(30.0, 0.5 * 2**self.failures))  # back off, then try again
            self._starting -= 1
            self.fill()
            return
        self.failures = 0
        self._starting -= 1
        if self._closed:
            await sandbox.close()
            return
        self._ready.append(sandbox)

    async def _ready_sandbox(self) -> Sandbox:
        sandbox = await self.backend.create(self.spec.model_copy(deep=True))
        if self.preload:
            try:
                await sandbox.preload(self.preload)
            except BaseException:
                await sandbox.close()
                raise
        return sandbox

    def take(self) -> Sandbox | None:
        """A ready sandbox, or None when the pool is empty; the pool refills either way."""
        sandbox = self._ready.popleft() if self._ready else None
        self.fill()
        return sandbox

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._ready:
            await self._ready.popleft().close()
