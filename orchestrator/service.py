"""The service's core, below HTTP: sessions plus the one way an execution is run and kept."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from pydantic import ValidationError

from orchestrator.config import Settings
from orchestrator.host_tools import (
    ChannelLimits,
    HostTool,
    ToolChannel,
    ToolRegistry,
    UnknownTools,
)
from orchestrator.instance_lock import InstanceLock
from orchestrator.metrics import METRICS
from orchestrator.outputs import OutputStore
from orchestrator.schemas import (
    CreateSessionRequest,
    ExecutionRecord,
    LimitsRequest,
    SessionInfo,
)
from orchestrator.sessions import Session, SessionError, SessionManager
from sandbox.kernel.collector import EventSink
from sandbox.spec import ResourceLimits, SandboxSpec

# A ceiling no request may pass, whatever it asks for.
LIMITS_CEILING = ResourceLimits(
    memory_mb=16384, cpus=4, pids=4096, file_size_mb=8192, open_files=65536,
    tmp_size_mb=8192, workspace_size_mb=16384,
)  # fmt: skip


class LimitTooHigh(SessionError):
    status = 400


class ImageNotAllowed(SessionError):
    status = 400


class ToolsNotAvailable(SessionError):
    """A session asked for host tools that are not registered, or its backend has no channel."""

    status = 400


class Service:
    def __init__(self, settings: Settings, tools: ToolRegistry | None = None) -> None:
        self.settings = settings
        self.outputs = OutputStore(
            settings.state_dir / "outputs",
            max_bytes_per_session=settings.outputs_max_bytes_per_session,
            max_bytes_total=settings.outputs_max_bytes_total,
        )
        self.sessions = SessionManager(settings, on_end=self._session_ended)
        # Host tools sessions may call: those given in code, then those the settings name.
        self.tools = tools if tools is not None else ToolRegistry()
        self.tools.configure(settings.host_tools)
        self._channels: dict[str, ToolChannel] = {}  # session id -> its tool channel
        self._instance_lock: InstanceLock | None = None  # held from start to close

    async def start(self) -> None:
        # First of all: a second instance on this state dir stops here, before it clears
        # anything that belongs to the live one.
        s = self.settings
        self._instance_lock = InstanceLock.acquire(s.state_dir, s.orchestrator_id)
        try:
            self.outputs.clear()
            await self.tools.start()
            self.tools.select(self.settings.host_tools.session_default)  # all must exist
            await self.sessions.start()
        except BaseException:  # what did start (MCP tool servers, backends) is stopped
            await self.close()
            raise

    async def close(self) -> None:
        try:
            await self.sessions.close()
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            await self.tools.close()
        finally:  # last: nothing of this instance is left running
            if self._instance_lock is not None:
                self._instance_lock.release()
                self._instance_lock = None

    async def _session_ended(self, session_id: str) -> None:
        # Off the loop: it may wait for a save writing a large execution, then delete files.
        await asyncio.to_thread(self.outputs.drop, session_id)
        channel = self._channels.pop(session_id, None)
        if channel is not None:
            channel.close()

    def session_tools(self, session: Session) -> list[str]:
        channel = self._channels.get(session.id)
        return list(channel.tools) if channel is not None else []

    def spec_for(self, request: CreateSessionRequest) -> SandboxSpec:
        spec = self.sessions.default_spec()
        if request.limits is not None:
            spec.limits = self._limits(request.limits)
        if request.image is not None:
            allowed = self.settings.docker_images or [self.settings.docker_image]
            if request.image not in allowed:
                raise ImageNotAllowed(
                    f"image {request.image!r} is not allowed here; allowed: {', '.join(allowed)}"
                )
            spec.image = request.image
        spec.host_tools = bool(request.tools)  # a pooled sandbox (no channel) will not fit
        return spec

    def _limits(self, request: LimitsRequest) -> ResourceLimits:
        wanted = request.model_dump(exclude_none=True)
        for name, value in wanted.items():
            ceiling = getattr(LIMITS_CEILING, name)
            if value > ceiling:
                raise LimitTooHigh(
                    f"limits.{name}={value} is above this service's ceiling of {ceiling}"
                )
        # Validated whole: a zero or negative limit would mean "unlimited" to some engines.
        merged = {**self.settings.default_limits.model_dump(), **wanted}
        try:
            return ResourceLimits.model_validate(merged)
        except ValidationError as exc:
            problems = "; ".join(f"limits.{e['loc'][0]}: {e['msg']}" for e in exc.errors())
            raise LimitTooHigh(problems) from None

    async def create_session(self, owner: str, request: CreateSessionRequest) -> Session:
        try:
            tools = self.tools.select(request.tools)
        except UnknownTools as exc:
            raise ToolsNotAvailable(str(exc)) from None
        name = request.backend or self.settings.default_backend
        backend = self.sessions.backends.get(name)
        if tools and backend is not None and not backend.supports_host_tools:
            raise ToolsNotAvailable(f"the {name} backend cannot give sandboxed code host tools")
        session = await self.sessions.create(
            owner, backend=request.backend, spec=self.spec_for(request), env=request.env
        )
        try:
            if tools:
                await self._open_channel(session, tools)
            for f in request.files:
                await session.sandbox.upload(f.path, f.content_base64)
        except Exception:
            await self.sessions.delete(session.id, owner)
            raise
        return session

    async def _open_channel(self, session: Session, tools: dict[str, HostTool]) -> None:
        channel = session.sandbox.host_channel
        assert channel is not None, "a backend that supports host tools made no channel"
        t = self.settings.host_tools
        limits = ChannelLimits(
            call_timeout_s=t.call_timeout_s,
            max_call_bytes=t.max_call_bytes,
            max_result_bytes=t.max_result_bytes,
            max_calls_in_flight=t.max_calls_in_flight,
        )
        self._channels[session.id] = await ToolChannel.open(channel, tools, limits)

    async def delete_session(self, session_id: str, owner: str) -> None:
        await self.sessions.delete(session_id, owner)

    async def run(
        self,
        session: Session,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
    ) -> ExecutionRecord:
        """Run code in a session, count it, keep its output, and return it with its ids."""
        limit = min(
            timeout_s or self.settings.execution_timeout_s, self.settings.max_execution_timeout_s
        )
        async with session.activity():
            execution = await session.sandbox.execute(
                code, timeout_s=limit, env=env, cwd=cwd, on_event=on_event
            )
        session.executions += 1
        METRICS.executions.labels(session.backend, execution.status).inc()
        METRICS.execution_seconds.labels(session.backend).observe(execution.duration_s)
        execution_id = await self.outputs.save(session.id, execution)
        return ExecutionRecord(**dict(execution), session_id=session.id, execution_id=execution_id)

    def info(self, session: Session) -> SessionInfo:
        s = self.settings
        return SessionInfo(
            id=session.id,
            backend=session.backend,
            limits=session.sandbox.spec.limits,
            created_at=datetime.fromtimestamp(session.created_at, UTC),
            idle_expires_in_s=max(
                0.0, (session.idle_timeout_s or s.idle_timeout_s) - session.idle_for()
            ),
            lifetime_expires_in_s=max(0.0, s.max_lifetime_s - session.age()),
            busy=session.busy > 0,
            executions=session.executions,
            from_pool=session.from_pool,
            tools=self.session_tools(session),
        )
