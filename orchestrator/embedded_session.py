"""A CodeSession of a service inside this process: the embedded front door.

It is a front door like REST or MCP, so it goes through `Service` (activity, caps, kept outputs
and metrics are done there once), on a service made for it alone: a private state dir, the one
backend it runs on, no pool, no keys, and no expiry (the session lasts as long as this object).
It implements the client's `CodeSession`; the client reaches it by the package entry point
`code_interpreter_client.sessions:embedded` (pyproject.toml), never by importing the server, so
`CodeSession.embedded` says which extra to install when the server's packages are missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from code_interpreter_client.code_session import (
    CodeSession,
    CommandOutputSink,
    ProcessStreamEvent,
    dropped_marker,
)
from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.processes import (
    CommandResult,
    ProcessEnd,
    ProcessInfo,
    ProcessOutput,
    ProcessRequest,
)
from code_interpreter_wire.rest import CreateSessionRequest
from code_interpreter_wire.results import EventSink, Execution, FileInfo
from code_interpreter_wire.spec import SandboxSpec
from orchestrator.auth import LOCAL_OWNER
from orchestrator.config import Settings
from orchestrator.process_state_dirs import own_state_dir
from orchestrator.service import Service
from orchestrator.sessions import Session, SessionError
from sandbox.backends.base import Backend
from sandbox.backends.registry import create_backend
from sandbox.processes.managed import Dropped

EMBEDDED_STATE_DIRS = "code-interpreter-embedded"
OUTPUTS_KEPT_BYTES = 1 << 16


class EmbeddedSettings(Settings):
    """Only what the embedded session sets counts: not the environment nor a config file,
    which are meant for a served instance (its keys, host tools, state dir)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def embedded_settings(backend: str, spec: SandboxSpec, state_dir: Path) -> EmbeddedSettings:
    return EmbeddedSettings(
        state_dir=state_dir,
        auth_disabled=True,  # one owner: this process
        backends=[backend],
        default_backend=backend,
        pool_size=0,
        # The caller's spec governs each call's time, as a bare sandbox's would; no ceiling
        # above what the caller asks, and no expiry: the session lives as long as its object.
        execution_timeout_s=spec.default_timeout_s,
        max_execution_timeout_s=math.inf,
        idle_timeout_s=math.inf,
        max_lifetime_s=math.inf,
        reap_interval_s=3600.0,
        # Files move within this process: as large as the workspace can hold.
        max_upload_bytes=spec.limits.workspace_size_mb << 20,
        max_download_bytes=spec.limits.workspace_size_mb << 20,
        # Nothing reads an embedded session's kept outputs back: keep the least the store allows.
        outputs_max_bytes_per_session=OUTPUTS_KEPT_BYTES,
        outputs_max_bytes_total=OUTPUTS_KEPT_BYTES,
        # The caller's spec is the policy and its own ceiling: no operator stands between.
        network_ceiling=spec.network,
        network_default=spec.network,
        # The session ends with its object: nothing to keep for a later process.
        pause_on_shutdown=False,
    )


class EmbeddedSession(CodeSession):
    def __init__(
        self, backend: str | Backend, spec: SandboxSpec | None, config: dict[str, Any], **kw: Any
    ) -> None:
        super().__init__(**kw)
        self._backend_name = backend if isinstance(backend, str) else backend.name
        self._given_backend = None if isinstance(backend, str) else backend  # the caller's
        self._spec = spec or SandboxSpec()
        self._config = config
        self._made_backend: Backend | None = None  # made from a name: ours to close
        self._service: Service | None = None
        self._state_dir: Path | None = None
        self._session: Session | None = None

    @property
    def session_id(self) -> str | None:
        return self._session.id if self._session is not None else None

    def _started_session(self) -> tuple[Service, Session]:
        if self._service is None or self._session is None:
            raise RuntimeError("the session starts with the first call")
        return self._service, self._session

    async def _start(self) -> None:
        try:
            backend = self._backend()
            # Under a directory of this process's own, which the next process to start sweeps
            # if this one dies without closing.
            base = Path(tempfile.gettempdir()) / f"{EMBEDDED_STATE_DIRS}-{os.getuid()}"
            own = own_state_dir(base)
            if base.stat().st_uid != os.getuid():  # a shared temp dir: made by someone else
                raise PermissionError(f"{base} belongs to another user; remove it")
            own.mkdir(mode=0o700, exist_ok=True)
            self._state_dir = Path(tempfile.mkdtemp(dir=own))
            settings = embedded_settings(self._backend_name, self._spec, self._state_dir)
            service = Service(settings, given_backends={self._backend_name: backend})
            await service.start()
            self._service = service
            request = CreateSessionRequest()
            self._session = await service.lifecycle.create(LOCAL_OWNER, request, spec=self._spec)
        except BaseException:
            await self._close()
            raise

    def _backend(self) -> Backend:
        """The backend given, or the one made here from its name (once: ours to close)."""
        if self._given_backend is not None:
            return self._given_backend
        if self._made_backend is None:
            self._made_backend = create_backend(self._backend_name, **self._config)
        return self._made_backend

    async def _execute(
        self, code: str, timeout_s: float | None, on_event: EventSink | None, language: str | None
    ) -> Execution:
        service, session = self._started_session()
        return await service.runs.execute(
            session, code, timeout_s=timeout_s, on_event=on_event, language=language
        )

    async def _languages(self) -> list[str]:
        if self._service is not None and self._session is not None:
            return self._service.views.session_languages(self._session)
        # Not started: what a sandbox of this spec would have, asked of its backend alone.
        return await self._backend().languages(self._spec)

    async def _upload(self, path: str, data: bytes) -> FileInfo:
        service, session = self._started_session()
        return await service.files.upload(session, path, data)

    async def _download(self, path: str) -> bytes:
        service, session = self._started_session()
        return await service.files.download(session, path)

    async def _list_files(self, path: str) -> list[FileInfo]:
        service, session = self._started_session()
        return await service.files.list_files(session, path)

    async def _run_command(
        self, request: ProcessRequest, on_output: CommandOutputSink | None
    ) -> CommandResult:
        service, session = self._started_session()
        if on_output is None:
            return await service.runs.run_command(session, request)
        # Followed as it runs: its listener opens before anything else runs on this loop, and
        # the replay holds what came first; leaving early kills it, as run_command would.
        pid = (await service.runs.start_process(session, request)).pid
        try:
            async for event in await service.runs.process_events(session, pid, replay=True):
                if isinstance(event, ProcessOutput):
                    await on_output(event)
                elif isinstance(event, Dropped):
                    await on_output(dropped_marker(event.bytes))
                elif isinstance(event, ProcessEnd):
                    break
            return await service.runs.wait_process(session, pid)
        finally:  # quietly: the sandbox may be closing, with its processes
            with contextlib.suppress(SandboxError, SessionError):
                if (await service.runs.process_info(session, pid)).running:
                    await service.runs.signal_process(session, pid, signal.SIGKILL)

    async def _start_process(self, request: ProcessRequest) -> ProcessInfo:
        service, session = self._started_session()
        return await service.runs.start_process(session, request)

    async def _process_events(self, pid: int, replay: bool) -> AsyncIterator[ProcessStreamEvent]:
        service, session = self._started_session()
        async for event in await service.runs.process_events(session, pid, replay=replay):
            yield dropped_marker(event.bytes) if isinstance(event, Dropped) else event

    async def _send_input(self, pid: int, data: bytes) -> None:
        service, session = self._started_session()
        await service.runs.send_input(session, pid, data)

    async def _signal_process(self, pid: int, signum: int) -> None:
        service, session = self._started_session()
        await service.runs.signal_process(session, pid, signum)

    async def _wait_process(self, pid: int) -> CommandResult:
        service, session = self._started_session()
        return await service.runs.wait_process(session, pid)

    async def _close(self) -> None:
        """End the session, the service, the backend if it was made here, and the state dir."""
        service, self._service, self._session = self._service, None, None
        backend, self._made_backend = self._made_backend, None
        state_dir, self._state_dir = self._state_dir, None
        try:
            if service is not None:
                await service.close()  # ends its sessions; leaves the backends it was given
        finally:
            try:
                if backend is not None:
                    await backend.close()
            finally:
                if state_dir is not None:
                    await asyncio.to_thread(_remove_state_dir, state_dir)


def _remove_state_dir(state_dir: Path) -> None:
    """This session's service directory, and this process's above it once it is empty (the
    per-user one stays: another process may be making its own in it right now)."""
    shutil.rmtree(state_dir, ignore_errors=True)
    with contextlib.suppress(OSError):  # not empty: another session of this process lives on
        state_dir.parent.rmdir()
