"""The E2B backend: sessions run in E2B microVMs (e2b_sandbox.py), made, paused, woken and
swept through the `e2b-code-interpreter` SDK.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Self

from e2b import (
    AuthenticationException,
    RateLimitException,
    SandboxQuery,
    SandboxState,
)
from e2b_code_interpreter import AsyncSandbox
from pydantic import BaseModel, Field

from code_interpreter_wire.errors import (
    BackendRateLimited,
    BackendUnavailable,
    SandboxStartError,
)
from code_interpreter_wire.languages import LANGUAGES
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, BackendCapabilities
from sandbox.backends.e2b_sandbox import E2BSandbox, working_directory

log = logging.getLogger(__name__)

_STALE_CONNECTION = "connection closed before message completed"
DEFAULT_TEMPLATE = "code-interpreter-v1"
ORCHESTRATOR_LABEL = "code-interpreter.orchestrator"


class E2BBackendConfig(BaseModel):
    """Where E2B is and how to use it. Unset values fall back to the SDK's own E2B_* variables."""

    api_key: str | None = Field(None, description="E2B API key (else E2B_API_KEY).")
    domain: str | None = Field(None, description="A self-hosted E2B's domain (else E2B_DOMAIN).")
    api_url: str | None = Field(None, description="The E2B API's URL, if not api.<domain>.")
    sandbox_url: str | None = Field(
        None, description="One URL for every sandbox's traffic (E2B_SANDBOX_URL), if any."
    )
    template: str = Field(DEFAULT_TEMPLATE, description="Template of new sandboxes.")
    sandbox_timeout_s: int = Field(
        3600,
        ge=60,
        description="E2B kills a sandbox this long after its last extension; executions extend "
        "it, so only an abandoned sandbox (a crashed orchestrator) runs out.",
    )
    metadata: dict[str, str] = Field(default_factory=dict, description="Set on every sandbox.")
    orchestrator_id: str | None = Field(
        None,
        description="Labels this orchestrator's sandboxes (metadata), so that those a crash "
        "left behind are found and killed on the next start.",
    )
    request_timeout_s: float = Field(60.0, gt=0, description="Per API request.")


class E2BBackend(Backend):
    name = "e2b"
    capabilities = BackendCapabilities(
        # No proxy of ours reaches it: E2B's own switch gives all or nothing.
        network_modes=("none", "any"),
        host_tools=False,  # a microVM elsewhere: no socket of ours reaches it
        processes=True,  # E2B's own commands and terminals
        suspend=True,  # E2B's own pause
        snapshot=True,
        shared_across_nodes=False,
        images=False,  # a template, not an image
        runtimes=False,
        warm_pool=False,  # an idle E2B sandbox is billed, and E2B kills it at its timeout
        labels_sandboxes=True,  # metadata on sandboxes in a cloud account others may share
        host_dirs=False,  # its files are in the microVM
        ports=False,  # E2B serves its sandboxes' ports itself
    )

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        return list(LANGUAGES)

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(E2BBackendConfig(**config))

    def __init__(self, config: E2BBackendConfig | None = None) -> None:
        self.config = config or E2BBackendConfig()

    def connection(self) -> dict[str, Any]:
        """The SDK's connection options, leaving out what is unset (so E2B_* apply)."""
        cfg = self.config
        options: dict[str, Any] = {
            "api_key": cfg.api_key,
            "domain": cfg.domain,
            "api_url": cfg.api_url,
            "sandbox_url": cfg.sandbox_url,
            "request_timeout": cfg.request_timeout_s,
        }
        return {k: v for k, v in options.items() if v is not None}

    def _label(self) -> dict[str, str]:
        orchestrator = self.config.orchestrator_id
        return {ORCHESTRATOR_LABEL: orchestrator} if orchestrator else {}

    async def cleanup_orphans(self) -> int:
        """Kill the sandboxes an earlier run of this orchestrator left running at E2B."""
        label = self._label()
        if not label or not (self.config.api_key or os.environ.get("E2B_API_KEY")):
            return 0
        # Running ones only: a paused one belongs to a paused session, kept in the service's
        # store (its deletion discards it).
        query = SandboxQuery(metadata=label, state=[SandboxState.RUNNING])
        paginator = AsyncSandbox.list(query=query, **self.connection())
        killed = 0
        while paginator.has_next:
            for info in await paginator.next_items():
                if await AsyncSandbox.kill(info.sandbox_id, **self.connection()):
                    killed += 1
        return killed

    async def create(self, spec: SandboxSpec | None = None) -> E2BSandbox:
        spec = spec or SandboxSpec()
        self.refuse_runtime(spec)
        cfg = self.config
        if not (cfg.api_key or os.environ.get("E2B_API_KEY")):
            raise BackendUnavailable(_missing_key(cfg) or "no E2B API key")
        if spec.host_tools:  # the service refuses earlier (400); a direct caller learns here
            raise SandboxStartError("host tools need a local or Docker sandbox: E2B has no channel")
        for attempt in (1, 2):
            try:
                remote = await AsyncSandbox.create(
                    template=spec.image or cfg.template,
                    timeout=cfg.sandbox_timeout_s,
                    metadata={**cfg.metadata, **spec.labels, **self._label()},
                    envs=dict(spec.env) or None,
                    allow_internet_access=spec.network.mode == "any",
                    **self.connection(),
                )
                break
            except AuthenticationException as exc:
                raise BackendUnavailable(f"E2B refused the API key: {exc}") from exc
            except RateLimitException as exc:
                raise BackendRateLimited(f"E2B is rate-limiting sandbox creation: {exc}") from exc
            except Exception as exc:
                # The SDK's pooled connection was closed by the server as idle just as the
                # request went out (the SDK retries refused connections, not these): once
                # more, on a new one. A sandbox made by the first all the same is labelled as
                # ours, and cleared with the orphans.
                if attempt == 1 and _STALE_CONNECTION in str(exc):
                    log.info("E2B create met a connection closed as idle; trying again")
                    continue
                raise SandboxStartError(f"could not create an E2B sandbox: {exc}") from exc
        try:
            workdir = await working_directory(remote)
        except BaseException:
            with contextlib.suppress(Exception):
                await remote.kill()
            raise
        return E2BSandbox(remote, spec, workdir, sandbox_timeout_s=cfg.sandbox_timeout_s)

    async def wake(self, handle: str, spec: SandboxSpec) -> E2BSandbox:
        """Resume a sandbox E2B paused, memory and all (E2B's connect resumes it)."""
        try:
            remote = await AsyncSandbox.connect(
                handle, timeout=self.config.sandbox_timeout_s, **self.connection()
            )
            workdir = await working_directory(remote)
        except Exception as exc:
            raise SandboxStartError(f"could not resume E2B sandbox {handle}: {exc}") from exc
        return E2BSandbox(remote, spec, workdir, sandbox_timeout_s=self.config.sandbox_timeout_s)

    async def suspend_left(self, sandbox_id: str) -> str | None:
        try:
            paused = await AsyncSandbox.pause(sandbox_id, **self.connection())
        except Exception:
            log.warning("E2B could not pause sandbox %s", sandbox_id, exc_info=True)
            return None
        return sandbox_id if paused is not None else None

    async def discard(self, handle: str) -> None:
        try:
            await AsyncSandbox.kill(handle, **self.connection())
        except Exception:
            log.warning("deleting paused E2B sandbox %s failed", handle, exc_info=True)


def why_unavailable(**config: Any) -> str | None:
    """What the E2B backend lacks to run with this configuration (sandbox/backends/registry.py)."""
    return _missing_key(E2BBackendConfig(**config))


def _missing_key(config: E2BBackendConfig) -> str | None:
    """What the E2B backend lacks to run: an API key (E2B's cloud or a self-hosted E2B)."""
    if not (config.api_key or os.environ.get("E2B_API_KEY")):
        return (
            "no E2B API key: set CODE_INTERPRETER_E2B_API_KEY (or E2B_API_KEY); for a "
            "self-hosted E2B also set its domain (E2B_DOMAIN) or API URL (E2B_API_URL)"
        )
    return None
