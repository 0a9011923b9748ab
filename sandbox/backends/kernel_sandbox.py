"""The part of a sandbox that local and Docker share: executing through the kernel driver."""

from __future__ import annotations

import json
from abc import abstractmethod

from sandbox.backends.base import Sandbox
from sandbox.errors import SandboxError
from sandbox.kernel.collector import EventSink
from sandbox.kernel.driver import KernelDriver
from sandbox.models import Execution
from sandbox.spec import SandboxSpec


class KernelSandbox(Sandbox):
    """A sandbox whose code runs in an ipykernel driven by `KernelDriver`."""

    def __init__(self, sandbox_id: str, spec: SandboxSpec, driver: KernelDriver) -> None:
        self.id = sandbox_id
        self.spec = spec
        self.driver = driver
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

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.driver.close()
        finally:
            await self._teardown()

    @abstractmethod
    async def _teardown(self) -> None:
        """Remove what the backend created for this sandbox (container, directories)."""
