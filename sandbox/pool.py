"""Warm pools: sandboxes started ahead of demand, so creating a session is a hand-over.

A pool holds up to `size` ready sandboxes of one backend and one spec. Taking one hands it over
at once and starts a replacement in the background. A sandbox leaves the pool once and is never
put back: sessions never share a sandbox. A pool with a preload runs it in each sandbox before
the sandbox counts as ready (`Sandbox.preload`: modules imported, caches warmed, nothing of it
visible to the session's code), so the first cell of a session pays for none of it.

A sandbox warms as background work (`Sandbox.weigh_cpu`), and the replacement for one handed
over starts `REFILL_DELAY_S` later, so the new session's first cells have the service and the
CPU to themselves (measured, local: a handed-over session's first `1+1` took 40-60 ms beside an
immediate refill, 9 ms with the refill half a second later; its first chart 153 -> 103 ms). A
take that finds the pool empty refills it at once: demand is outrunning it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, Sandbox
from sandbox.preload import PreloadFailed

log = logging.getLogger(__name__)

REFILL_DELAY_S = 0.5
# A preload that failed this many times in a row is given up: the pool serves sandboxes
# without it (saying so once) rather than none.
MAX_PRELOAD_FAILURES = 3


class WarmPool:
    def __init__(
        self,
        backend: Backend,
        spec: SandboxSpec,
        size: int,
        *,
        preload: str = "",
        refill_delay_s: float = REFILL_DELAY_S,
    ) -> None:
        self.backend = backend
        self.preload = preload
        self.refill_delay_s = refill_delay_s
        self._refill: asyncio.TimerHandle | None = None
        self.spec = spec
        self.size = size
        self._ready: deque[Sandbox] = deque()
        self._starting = 0
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[asyncio.Task[None]] = set()  # awaited at close, never cancelled
        self.failures = 0
        self.preload_failures = 0

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
            await self._close_later(sandbox)
            return
        self._ready.append(sandbox)

    async def _ready_sandbox(self) -> Sandbox:
        sandbox = await self.backend.create(self.spec.model_copy(deep=True))
        try:  # warmed as background work: live sessions come first (measured: a handed-over
            # session's first cell took 50 ms instead of 9 beside a refill's imports)
            try:
                sandbox.weigh_cpu(background=True)
            except OSError:
                log.exception("a pooled sandbox warms at a live session's CPU weight")
            if self.preload:
                await self._preload(sandbox)
        except BaseException:
            await self._close_later(sandbox)
            raise
        return sandbox

    async def _preload(self, sandbox: Sandbox) -> None:
        try:
            await sandbox.preload(self.preload)
        except PreloadFailed as exc:  # its code's own error: a time limit on a busy host is not
            self.preload_failures += 1
            if self.preload_failures >= MAX_PRELOAD_FAILURES:
                log.error(
                    "the %s pool's preload failed %d times in a row (%s): its sandboxes are "
                    "served without it; fix preload_modules/preload_code and restart",
                    self.backend.name,
                    self.preload_failures,
                    exc,
                )
                self.preload = ""
            raise
        self.preload_failures = 0

    async def _close_later(self, sandbox: Sandbox) -> None:
        """Close `sandbox` whatever befalls the caller: a close cut half-way (the pool closing
        cancels its starts) would leave its container, cgroup or uid behind."""
        task = asyncio.ensure_future(sandbox.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        await asyncio.shield(task)

    def take(self) -> Sandbox | None:
        """A ready sandbox, or None when the pool is empty; the pool refills either way."""
        sandbox = self._ready.popleft() if self._ready else None
        if sandbox is not None:
            try:
                sandbox.weigh_cpu(background=False)  # a live session's now
            except OSError:  # never a session starved by a pool's weight: started anew
                log.exception("a pooled sandbox's CPU weight could not be restored; dropped")
                task = asyncio.ensure_future(sandbox.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
                sandbox = None
        if sandbox is None or self.refill_delay_s <= 0:
            self.fill()
        elif self._refill is None:
            self._refill = asyncio.get_running_loop().call_later(
                self.refill_delay_s, self._refill_now
            )
        return sandbox

    def _refill_now(self) -> None:
        self._refill = None
        self.fill()

    async def close(self) -> None:
        self._closed = True
        if self._refill is not None:
            self._refill.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)
        while self._ready:
            await self._ready.popleft().close()
