"""The service's core, below HTTP: sessions, and the one way each thing is done in one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import re
import time
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import ValidationError

from kernel_images.labels import FULL_IMAGE
from orchestrator.cluster.lost_guard import LostGuard
from orchestrator.cluster.shared import SHARED_BACKENDS, RelayedTools, SharedSandbox, inner
from orchestrator.cluster.tool_relay import ToolRelays
from orchestrator.config import Settings
from orchestrator.egress import EgressRecord
from orchestrator.governance import audit_kinds as audited
from orchestrator.governance import policy_checks
from orchestrator.governance.approval_outcome import ApprovalOutcome
from orchestrator.governance.approvals import Approvals
from orchestrator.governance.audit import AuditLog, command_line, end_reason
from orchestrator.governance.errors import ApprovalDenied, PolicyDenied
from orchestrator.governance.input_audit import InputAudit
from orchestrator.governance.policy import Principal
from orchestrator.governance.principals import Principals
from orchestrator.governance.process_origins import command_origin, start_origin
from orchestrator.governance.tool_guard import SessionToolGuard
from orchestrator.host_tools import (
    ChannelLimits,
    HostTool,
    ToolChannel,
    ToolRegistry,
    UnknownTools,
)
from orchestrator.host_tools.describe import summaries
from orchestrator.instance_lock import InstanceLock
from orchestrator.metrics import METRICS
from orchestrator.outputs import KeptFile, OutputStore
from orchestrator.saved_states import SavedStateQuotaReached, SavedStates
from orchestrator.schemas import (
    CreateSessionRequest,
    EgressConnection,
    ExecutionRecord,
    LimitsRequest,
    NetworkReport,
    ResumeInfo,
    SessionInfo,
    SnapshotInfo,
)
from orchestrator.session_egress import SessionEgress
from orchestrator.sessions import (
    BackendNotEnabled,
    Session,
    SessionBusy,
    SessionError,
    SessionManager,
)
from orchestrator.state_store import SessionRecord, SnapshotRecord, SqliteStore
from orchestrator.streaming import Dropped, Finished, Keepalive, follow
from orchestrator.tool import SHELL_TOOL_NAME, RenderedOutput, render, render_command
from sandbox.backends.base import Backend
from sandbox.errors import FileTooLarge, LanguageUnavailable, SandboxError, UnknownLanguage
from sandbox.languages import PYTHON, canonical_language, check_available
from sandbox.models import EventSink, Execution, FileInfo, OutputEvent
from sandbox.network_policy import NO_NETWORK, NetworkPolicy
from sandbox.processes.managed import ProcessEvent
from sandbox.processes.models import CommandResult, ProcessInfo, ProcessRequest, TerminalSize
from sandbox.spec import ResourceLimits, SandboxSpec, limit_ceilings

if TYPE_CHECKING:
    from orchestrator.state_store.redis_store import RedisStore

log = logging.getLogger(__name__)

# The ceiling no request may pass, whatever it asks for: ResourceLimits' own upper bounds.
LIMITS_CEILING = limit_ceilings()


class LimitTooHigh(SessionError):
    status = 400


class ImageNotAllowed(SessionError):
    status = 400


class RuntimeNotAllowed(SessionError):
    """A runtime the operator does not allow, the engine lacks, or the backend has no choice of."""

    status = 400


class NetworkNotAllowed(SessionError):
    """A network policy beyond the operator's ceiling, or on a backend that cannot hold one."""

    status = 400


class PauseUnsupported(SessionError):
    """Pause, resume and snapshots of a session whose backend cannot keep one across them."""

    status = 409

    def __init__(self, backend: str) -> None:
        super().__init__(
            f"the {backend} backend does not keep sessions across pauses yet: no pause, resume "
            "or snapshot of its sessions; a session that is idle too long ends instead. Save "
            "what you need with a download, or use a backend of one machine (local, docker)"
        )


class ResumeFailed(SessionError):
    """A paused session could not be started again; it stays paused, nothing lost."""

    status = 503


class ToolsNotAvailable(SessionError):
    """A session asked for host tools that are not registered, or its backend has no channel."""

    status = 400


class ShellToolOff(SessionError):
    """The `run_command` tool is asked for, but the operator has not turned it on."""

    status = 404

    def __init__(self) -> None:
        super().__init__(
            f"the {SHELL_TOOL_NAME} tool is off on this service; the operator turns it on "
            "with CODE_INTERPRETER_SHELL_TOOL=true (the shell_tool setting)"
        )


_PLACEHOLDER = ".cir-make-dir"
POLICY_DENIED = "policy_denied"  # a tool call's status when its key's policy refused it
APPROVAL_DENIED = "approval_denied"  # ... when a human denied it (or no one answered in time)
HINT_NEW_SESSION = " Omit session_id to start a new session."
HINT_NEW_SESSION_STATE = " Omit session_id to start a new session (earlier variables will be gone)."


def _outcome(result: CommandResult) -> str:
    if result.timed_out:
        return "timeout"
    return "ok" if result.exit_code == 0 else "error"


# Where a rendered tool output points: (the full output's URL, each artifact's URL by id).
OutputLinks = Callable[[str, ExecutionRecord], tuple[str | None, dict[str, str]]]


class DefaultToolSession(CreateSessionRequest):
    """The session a tool front starts by itself: its default host tools that the key's policy
    does not allow are left out, not refused (the model asked for none of them)."""


@dataclass
class ToolOutcome:
    """A tool call's result: the session it ran in, the record (None when the call was
    refused, and for `run_command`, whose commands are not kept), and the output a model
    reads."""

    session_id: str | None
    record: ExecutionRecord | None
    rendered: RenderedOutput
    status: str  # an ExecutionStatus, or why the call was refused

    @staticmethod
    def refused(message: str, status: str, session_id: str | None = None) -> ToolOutcome:
        return ToolOutcome(session_id, None, RenderedOutput(f"[error] {message}", [], True), status)


class Service:
    """The application layer: the only door into a session. Every front door (REST, tool
    invoke, MCP, the E2B front, embedded sessions) parses, calls this, and formats; activity,
    caps and metrics happen here once."""

    def __init__(
        self,
        settings: Settings,
        tools: ToolRegistry | None = None,
        *,
        given_backends: Mapping[str, Backend] | None = None,
    ) -> None:
        """`given_backends`: backends the caller made and will close (by name), used instead of
        making them from the settings (an embedded session's own)."""
        self.settings = settings
        self.outputs = OutputStore(
            settings.state_dir / "outputs",
            max_bytes_per_session=settings.outputs_max_bytes_per_session,
            max_bytes_total=settings.outputs_max_bytes_total,
        )
        # Cluster mode (docs/cluster.md): records in a store every replica shares, and a
        # session manager that keeps only a cache of them.
        self._shared: RedisStore | None = None
        if settings.store_url is not None:  # Redis and Ray are imported for it only
            from orchestrator.cluster.sessions import ClusterSessionManager
            from orchestrator.state_store.redis_store import RedisStore

            self._shared = RedisStore(
                settings.store_url.get_secret_value(),
                snapshots_dir=settings.state_dir / "snapshots",
                prefix=settings.store_prefix,
                tombstone_ttl_s=settings.cluster_tombstone_ttl_s,
                max_lifetime_s=settings.max_lifetime_s,
                timeout_s=settings.store_timeout_s,
                allow_unauthenticated=settings.store_allow_unauthenticated,
            )
            self.sessions: SessionManager = ClusterSessionManager(
                settings,
                self._shared,
                on_end=self._session_ended,
                given_backends=given_backends,
                on_expiry=self._expired,
                before_cleanup=self._salvage,
                on_sweep=self._sweep,
                on_attach=self._attached,
            )
        else:
            self.sessions = SessionManager(
                settings,
                on_end=self._session_ended,
                given_backends=given_backends,
                on_expiry=self._expired,
                before_cleanup=self._salvage,
                on_sweep=self._sweep,
            )
        self._relays = ToolRelays()  # host tools of sessions whose sandbox is elsewhere
        # Made in start(), once this instance holds the state dir.
        self._store: SqliteStore | RedisStore | None = None
        self._saved: SavedStates | None = None
        # One change of state (pause, resume) at a time per session; calls wait for it.
        self._changing: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        # Host tools sessions may call: those given in code, then those the settings name.
        self.tools = tools if tools is not None else ToolRegistry()
        self.tools.configure(settings.host_tools)
        self._channels: dict[str, ToolChannel] = {}  # session id -> its tool channel
        self.egress = SessionEgress(settings, on_connection=self._egress_connection)
        # Who each owner id is, and its policy: the settings' keys until start() reads the
        # store's too (docs/governance.md).
        self.principals = Principals(settings, None)
        self._making: dict[str, int] = {}  # owner -> its sessions being made (max_sessions)
        self._revoked_ended: set[str] = set()  # revoked principals with nothing left to end
        # What ran, who asked, when (docs/governance.md); writes once start() has the store.
        self.audit = AuditLog(settings, name_of=self._principal_name)
        self.input_audit = InputAudit(  # what is typed into terminals and processes' stdin
            self.audit,
            record_bytes=settings.audit_input_record_bytes,
            records_per_minute=settings.audit_input_records_per_minute,
        )
        # Humans who approve risky calls (docs/governance.md); asks the store start() opens.
        self.approvals = Approvals(
            settings,
            lambda: self.store.approvals,
            principal_of=lambda owner: self.principals.of(owner),
            audit=self.audit,
            origins_of=lambda: getattr(self.store, "origins", None),  # shared: Redis's
        )
        self._instance_lock: InstanceLock | None = None  # held from start to close

    async def start(self) -> None:
        # First of all: a second instance on this state dir stops here, before it clears
        # anything that belongs to the live one.
        s = self.settings
        self._instance_lock = InstanceLock.acquire(s.state_dir, s.orchestrator_id)
        try:
            self.outputs.clear()
            if self._shared is not None:
                self._shared.ping()  # an unreachable store stops the start, saying which
            self._store = self._shared or SqliteStore(s.state_dir)
            self.audit.start(self._store.audit)
            self.principals = Principals(s, self._store.principals)
            await self.principals.start()
            self._saved = SavedStates(s, self._store)
            await self._saved.remove_unrecorded()
            await self.tools.start()
            self.tools.select(self.settings.host_tools.session_default)  # all must exist
            await self.sessions.start()
        except BaseException:  # what did start (MCP tool servers, backends) is stopped
            await self.close()
            raise

    async def close(self) -> None:
        try:
            await self._pause_all()
            await self.sessions.close()
            await self._relays.close()
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            await self.egress.close_all()
            await self.approvals.close()
            self.input_audit.close()  # input typed and not yet written, into the log below
            await self.audit.close()  # after the sessions' ends, so those are kept too
            await self.principals.close()
            await self.tools.close()
            if self._store is not None:
                self._store.close()
        finally:  # last: nothing of this instance is left running
            if self._instance_lock is not None:
                self._instance_lock.release()
                self._instance_lock = None

    @property
    def store(self) -> SqliteStore | RedisStore:
        if self._store is None:
            raise RuntimeError("the service is not started")
        return self._store

    @property
    def saved(self) -> SavedStates:
        if self._saved is None:
            raise RuntimeError("the service is not started")
        return self._saved

    async def _session_ended(self, session_id: str) -> None:
        self.approvals.abandon_session(session_id)  # what waits for a human in it goes now
        self.input_audit.forget_session(session_id)
        ended = self.sessions.why_ended(session_id)
        if ended is not None:  # None: another replica ended it, and recorded it
            self._audit_ended(session_id, *ended)
        if self._store is not None:
            await self._forget_record(session_id)
        # Off the loop: it may wait for a save writing a large execution, then delete files.
        await asyncio.to_thread(self.outputs.drop, session_id)
        await self._close_channels(session_id)

    async def _close_channels(self, session_id: str) -> None:
        """Close what a session's sandbox reaches the host through: its tool channel and its
        egress proxy (when it ends, is paused, or fails to resume); what was typed into its
        processes is written to the audit log now (they are gone)."""
        self.input_audit.flush_session(session_id)
        await self._relays.stop(session_id)
        channel = self._channels.pop(session_id, None)
        if channel is not None:
            channel.close()
        await self.egress.close(session_id)

    def host_tool_summaries(self, names: list[str]) -> list[tuple[str, str]]:
        """(call signature, summary) of each named host tool, for the tool's description."""
        return summaries(self.tools.select(names).values())

    def session_tools(self, session: Session) -> list[str]:
        channel = self._channels.get(session.id)
        return list(channel.tools) if channel is not None else []

    # --- keys' policies (docs/governance.md): checked here, behind every front door
    @contextlib.contextmanager
    def _enforcing(self, owner: str, session_id: str | None = None) -> Iterator[Principal]:
        """The owner's principal, to check a request against its policy; a refusal is kept
        in the audit log. A revoked key's is refused everything (its sessions end at the next
        sweep; until then, what still reaches them, e.g. an E2B sandbox token, runs nothing)."""
        try:
            who = self.principals.of(owner)
            if self.principals.is_revoked(owner):
                raise PolicyDenied.revoked(who.name)
            yield who
        except PolicyDenied as exc:
            self.audit.record(
                audited.POLICY_DENIED,
                owner=owner,
                session_id=session_id,
                status="denied",
                details={"rule": exc.rule, "message": str(exc)},
            )
            raise

    def check_commands(self, owner: str, session_id: str | None = None) -> None:
        """Refuse shell commands, background processes and terminals to a key whose policy
        says `commands: false` (PolicyDenied)."""
        with self._enforcing(owner, session_id) as who:
            policy_checks.check_commands(who)

    @contextlib.asynccontextmanager
    async def _session_slot(self, owner: str) -> AsyncIterator[None]:
        """Hold a place under the key's `max_sessions` while a session of its is made or
        resumed (beside the service's own cap per key, which the session manager keeps)."""
        who = self.principals.of(owner)
        if who.policy.max_sessions is None:
            yield
            return
        if self._shared is not None:  # every replica's, as the store counts them
            held = await asyncio.to_thread(self._shared.slots_held, owner)
        else:
            held = len(self.sessions.list(owner))
        with self._enforcing(owner):
            policy_checks.check_session_count(who, held + self._making.get(owner, 0))
        self._making[owner] = self._making.get(owner, 0) + 1
        try:
            yield
        finally:
            self._making[owner] -= 1
            if not self._making[owner]:
                del self._making[owner]

    def spec_for(self, request: CreateSessionRequest) -> SandboxSpec:
        spec = self.sessions.default_spec()
        if request.limits is not None:
            spec.limits = self._limits(request.limits)
        if request.image is not None:
            allowed = self.settings.docker_images or [self.settings.docker_image, FULL_IMAGE]
            if request.image not in allowed:
                raise ImageNotAllowed(
                    f"image {request.image!r} is not allowed here; allowed: {', '.join(allowed)}"
                )
            spec.image = request.image
        if request.runtime is not None and request.runtime != self._deployment_runtime():
            spec.runtime = request.runtime  # the deployment's own stays unset: pools fit it
        spec.host_tools = bool(request.tools)  # a pooled sandbox (no channel) will not fit
        if request.network is not None:
            spec.network = self.network_policy(request.network)
        return spec

    def network_policy(self, asked: NetworkPolicy) -> NetworkPolicy:
        """`asked`, if it fits within the operator's ceiling; else `NetworkNotAllowed` saying
        what the ceiling allows."""
        why = asked.beyond(self.settings.network_ceiling)
        if why:
            raise NetworkNotAllowed(
                f"network policy refused: {why}. Ask for less, or ask the operator to raise "
                "the ceiling (network_ceiling)"
            )
        return asked

    def _check_network_holdable(self, name: str, backend: Backend, policy: NetworkPolicy) -> None:
        """Refuse a policy the backend cannot enforce whole, rather than drop part of it: a
        backend without our proxy (e2b) holds only all or nothing, so no deny rule either."""
        if policy.mode not in backend.network_modes:
            raise NetworkNotAllowed(
                f"the {name} backend cannot hold a {policy.mode} network policy (it can: "
                f"{', '.join(backend.network_modes)}); use the local or docker backend"
            )
        proxied = "allow_list" in backend.network_modes
        deny = policy.deny or (self.settings.network_ceiling.deny if policy.enabled else ())
        if deny and not proxied:
            raise NetworkNotAllowed(
                f"the {name} backend cannot hold deny rules ({', '.join(map(str, deny[:4]))}, "
                "from the session's policy or the deployment's ceiling): its network is all or "
                "nothing; use the local or docker backend"
            )

    def _deployment_runtime(self) -> str:
        return self.settings.docker_runtime or "runc"

    async def _check_runtime(self, name: str, backend: Backend, runtime: str) -> None:
        """Refuse a runtime the backend has no choice of, or that is not both allowed by the
        operator and known to the engine; the refusal names those that are."""
        known = await backend.runtimes()
        if not known:
            raise RuntimeNotAllowed(
                f"the {name} backend has no choice of runtime (asked: {runtime!r}); "
                "use the docker backend, or leave runtime unset"
            )
        allowed = [r for r in self.settings.docker_runtimes if r in known]
        if runtime not in allowed:
            raise RuntimeNotAllowed(
                f"runtime {runtime!r} is not allowed here; allowed: {', '.join(allowed) or 'none'}"
            )

    def _limits(self, request: LimitsRequest) -> ResourceLimits:
        wanted = request.model_dump(exclude_none=True)
        for name, value in wanted.items():
            ceiling = LIMITS_CEILING[name]
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

    async def create_session(
        self,
        owner: str,
        request: CreateSessionRequest,
        *,
        idle_timeout_s: float | None = None,
        spec: SandboxSpec | None = None,
        workdir: str | None = None,
    ) -> Session:
        """A new session for `owner`: the only way one is made. `idle_timeout_s`: an expiry of
        its own (sooner than the service's), for sessions a client may forget. `spec`: a whole
        spec from in-process code (an embedded session's), taken as it is, past the ceilings a
        request is held to. `workdir`: where its kernels run (`SandboxSpec.workdir`; the E2B
        front's are in E2B's home), set after the sandbox is had, so a pooled one fits too."""
        if isinstance(request, DefaultToolSession):  # what the key may not use is left out
            allowed = policy_checks.allowed_tools(self.principals.of(owner), request.tools)
            request = request.model_copy(update={"tools": allowed})
        try:
            tools = self.tools.select(request.tools)
        except UnknownTools as exc:
            raise ToolsNotAvailable(str(exc)) from None
        # Refused before a sandbox is made for it, and kept from deletion until restored.
        with self.saved.pinned(owner, request.snapshot_id) as snapshot:
            if snapshot is not None:
                request = _from_snapshot(request, snapshot)
            return await self._create_session(
                owner, request, tools, snapshot, idle_timeout_s, spec, workdir
            )

    async def _create_session(
        self,
        owner: str,
        request: CreateSessionRequest,
        tools: dict[str, HostTool],
        snapshot: SnapshotRecord | None,
        idle_timeout_s: float | None,
        spec: SandboxSpec | None,
        workdir: str | None,
    ) -> Session:
        with self._enforcing(owner) as who:  # none named: the default, or one the key may use
            name = request.backend or policy_checks.fit_backend(
                who, self.settings.default_backend, self.backend_names()
            )
            policy_checks.check_request(who, name, request)
        if snapshot is not None and name in SHARED_BACKENDS:
            raise PauseUnsupported(name)
        backend = self.sessions.backends.get(name)
        if tools and backend is not None and not backend.supports_host_tools:
            raise ToolsNotAvailable(f"the {name} backend cannot give sandboxed code host tools")
        if request.runtime is not None and backend is not None:
            await self._check_runtime(name, backend, request.runtime)
        if spec is None:
            spec = self.spec_for(request)
            with self._enforcing(owner) as who:  # what it left unset, within the policy
                offered = self.settings.docker_images or [self.settings.docker_image, FULL_IMAGE]
                spec = policy_checks.fit_spec(
                    who,
                    spec,
                    request,
                    backend=name,
                    default_image=self.settings.docker_image,
                    offered_images=offered,
                )
        if backend is not None:
            self._check_network_holdable(name, backend, spec.network)
        async with self._session_slot(owner):
            session = await self.sessions.create(owner, backend=name, spec=spec, env=request.env)
        self._audit_created(session, tools, snapshot)
        session.idle_timeout_s = idle_timeout_s
        try:
            await self.egress.open(session)
            if workdir is not None and workdir != session.sandbox.spec.workdir:
                await session.sandbox.set_workdir(workdir)
            if tools:
                await self._open_channel(session, tools)
            if snapshot is not None:
                restored = await self.saved.restore(session, snapshot)
                session.notice = f"started from snapshot {snapshot.id}: {restored.notice}"
            for f in request.files:
                await self.upload(session, f.path, f.content_base64)
            if idle_timeout_s is not None:  # a session a client may forget ends, not kept
                session.on_idle = "end"
            # In the try: a store that fails here leaves no sandbox running that no record names.
            self.store.put_session(self._record_of(session))
        except BaseException:  # a caller that left (cancelled) leaves no session behind
            await self.sessions.delete(session.id, owner)
            raise
        return session

    def _record_of(self, session: Session) -> SessionRecord:
        return SessionRecord(
            id=session.id,
            owner=session.owner,
            backend=session.backend,
            spec=session.sandbox.spec,
            tools=self.session_tools(session),
            languages=self.session_languages(session),
            idle_timeout_s=session.idle_timeout_s,
            on_idle=session.on_idle,
            created_at=session.created_at,
            sandbox_id=session.sandbox.id,
            sandbox_handle=session.sandbox.handle,
            executions=session.executions,
            labels=session.labels,
        )

    def set_labels(self, session: Session, labels: dict[str, str]) -> None:
        """Keep a front's own data with a session (E2B's metadata, its timeout): it outlives
        pauses and restarts with the session's record."""
        session.labels = dict(labels)
        record = self.store.get_session(session.id)
        if record is None:
            return
        record.labels = session.labels
        if isinstance(self.store, SqliteStore):
            self.store.put_session(record)
        else:  # only if no other replica deleted it meanwhile: never brought back
            self.store.update_session(record)

    async def _forget_record(self, session_id: str) -> None:
        """Delete a session's record and its paused state, if any."""
        record = self.store.get_session(session_id)
        if record is None:
            return
        if record.saved_state is not None:
            self.store.delete_snapshot(record.saved_state)
        backend = self.sessions.backends.get(record.backend)
        if record.suspended is not None and backend is not None:
            await backend.discard(record.suspended)
        self.store.delete_session(session_id)

    async def _open_channel(
        self, session: Session, tools: dict[str, HostTool], *, attached: bool = False
    ) -> None:
        """Serve a session's host tools; `attached`: a session another replica made, whose
        manifest that replica wrote (every replica has the same host-tool settings). The channel
        is kept only once it serves: a failure leaves none, so a later attempt makes one."""
        t = self.settings.host_tools
        limits = ChannelLimits(
            call_timeout_s=t.call_timeout_s,
            max_call_bytes=t.max_call_bytes,
            max_result_bytes=t.max_result_bytes,
            max_calls_in_flight=t.max_calls_in_flight,
            approval_timeout_s=self.settings.approval_timeout_s,
        )
        owner = session.owner
        guard = SessionToolGuard(  # its key's policy, approvals, an audit event per call
            self.approvals,
            session_id=session.id,
            owner=owner,
            policy_of=lambda: self.principals.of(owner).policy,
            revoked=lambda: self.principals.is_revoked(owner),
            audit=self.audit,
        )
        relayed = inner(session.sandbox)
        if isinstance(relayed, RelayedTools):  # its channel is on its own machine: relayed
            relay = ToolChannel.relayed(tools, limits, guard)
            await self._relays.start(session.id, relayed, relay, write_manifest=not attached)
            self._channels[session.id] = relay
            return
        channel = session.sandbox.host_channel
        assert channel is not None, "a backend that supports host tools made no channel"
        self._channels[session.id] = await ToolChannel.open(channel, tools, limits, guard)

    async def _attached(self, session: Session, record: SessionRecord) -> None:
        """A session another replica made, now served here too: its host tools with it."""
        if record.tools and session.id not in self._channels:
            try:  # the relay starts at once (no call here): it retries what fails itself
                await self._open_channel(session, self.tools.select(record.tools), attached=True)
            except UnknownTools as exc:
                log.warning("session %s: its host tools are not here: %s", session.id, exc)

    # --- the audit log: one helper per kind of event the service records
    def _principal_name(self, owner: str) -> str:
        return self.audit_viewer(owner).name

    def audit_viewer(self, owner: str) -> Principal:
        """Who reads the audit log: an admin reads every key's events, others their own."""
        return self.principals.of(owner)

    def _audit_created(
        self, session: Session, tools: dict[str, HostTool], snapshot: SnapshotRecord | None
    ) -> None:
        spec = session.sandbox.spec
        self.audit.record(
            audited.SESSION_CREATED,
            owner=session.owner,
            session_id=session.id,
            details={
                "backend": session.backend,
                "image": spec.image,
                "runtime": spec.runtime,
                "network": spec.network.mode,
                "tools": sorted(tools),
                "snapshot_id": snapshot.id if snapshot is not None else None,
                "from_pool": session.from_pool,
            },
        )

    def _audit_ended(self, session_id: str, owner: str, why: str) -> None:
        self.audit.record(
            audited.SESSION_ENDED,
            owner=owner,
            session_id=session_id,
            status=end_reason(why),
            details={"reason": end_reason(why), "why": why},
        )

    def _audit_execution(
        self,
        session: Session,
        code: str,
        language: str,
        execution: Execution | None,
        execution_id: str | None,
        failure: BaseException | None = None,
    ) -> None:
        details: dict[str, object] = {
            "execution_id": execution_id,
            "language": language,
            "code": code,
        }
        if execution is not None:
            details |= {
                "stdout_chars": len(execution.stdout) + execution.stdout_dropped,
                "stderr_chars": len(execution.stderr) + execution.stderr_dropped,
                "results": len(execution.results),
                "images": sum(
                    1 for r in execution.results for i in (r.png, r.jpeg, r.svg) if i is not None
                ),
                "error": execution.error.name if execution.error is not None else None,
            }
        else:
            details["failure"] = f"{type(failure).__name__}: {failure}"
        self.audit.record(
            audited.EXECUTION,
            owner=session.owner,
            session_id=session.id,
            status=str(execution.status) if execution is not None else "failed",
            duration_s=execution.duration_s if execution is not None else None,
            details=details,
        )

    def _command_line(self, request: ProcessRequest) -> str:
        return command_line(request.argv, request.command, self.settings.audit_max_code_chars)

    def _audit_command(
        self,
        session: Session,
        request: ProcessRequest,
        result: CommandResult | None,
        failure: BaseException | None = None,
        *,
        file_transfer: bool = False,
    ) -> None:
        details: dict[str, object] = {"command": self._command_line(request)}
        if file_transfer:  # a front's file operation, shown as one (not as the key's command)
            details["file_transfer"] = True
        if result is not None:
            details |= {
                "pid": result.pid,
                "exit_code": result.exit_code,
                "signal": result.signal,
                "stdout_chars": len(result.stdout) + result.stdout_dropped,
                "stderr_chars": len(result.stderr) + result.stderr_dropped,
            }
        else:
            details["failure"] = f"{type(failure).__name__}: {failure}"
        self.audit.record(
            audited.COMMAND,
            owner=session.owner,
            session_id=session.id,
            status=_outcome(result) if result is not None else "failed",
            duration_s=result.duration_s if result is not None else None,
            details=details,
        )

    def _audit_file(self, kind: str, session: Session, path: str, size: int | None = None) -> None:
        self.audit.record(
            kind,
            owner=session.owner,
            session_id=session.id,
            details={"path": path, "bytes": size},
        )

    def _egress_connection(self, session: Session, entry: EgressRecord) -> None:
        self.audit.record(
            audited.EGRESS_CONNECTION,
            owner=session.owner,
            session_id=session.id,
            status="allowed" if entry.allowed else "refused",
            duration_s=entry.duration_s,
            details={
                "method": entry.method,
                "host": entry.host,
                "port": entry.port,
                "address": entry.address,
                "reason": entry.reason,
                "bytes_up": entry.bytes_up,
                "bytes_down": entry.bytes_down,
            },
        )

    # --- sessions: every way in goes through these
    async def get_session(self, session_id: str, owner: str) -> Session:
        """The owner's session, resumed first if it was paused (the call that finds it paused
        wakes it); else SessionNotFound/SessionExpired (another key's session is reported
        exactly like a missing one)."""
        live = self.sessions.live(session_id)
        if live is not None and session_id not in self._changing:
            return await self.sessions.get(session_id, owner)
        async with self._lock_of(session_id):
            if self.sessions.live(session_id) is None:
                record = self._paused_record(session_id, owner)
                if record is not None:
                    return await self._resume(record)
            return await self.sessions.get(session_id, owner)

    def _lock_of(self, session_id: str) -> asyncio.Lock:
        lock = self._changing.get(session_id)
        if lock is None:
            lock = self._changing[session_id] = asyncio.Lock()
        return lock

    def _paused_record(self, session_id: str, owner: str) -> SessionRecord | None:
        record = self.store.get_session(session_id) if session_id.startswith("s-") else None
        if record is None or record.owner != owner or record.state != "paused":
            return None
        return record

    async def session_state(self, session_id: str, owner: str) -> Session | SessionRecord | None:
        """The owner's session as it is now, without waking it: live, paused, or None. In
        cluster mode a running session another replica made is attached (found in the store).
        The store is read off the event loop (E2B's sweep and listing ask of every sandbox)."""
        live = self.sessions.live(session_id)
        if live is not None and live.owner == owner:
            return live
        paused = await asyncio.to_thread(self._paused_record, session_id, owner)
        live = self.sessions.live(session_id)  # resumed here while the store answered
        if live is not None and live.owner == owner:
            return live
        if paused is not None or live is not None or self._shared is None:
            return paused
        try:  # the caller asks describe_session why, when it wants to say
            return await self.sessions.get(session_id, owner)
        except SessionError:
            return None

    async def describe_session(self, session_id: str, owner: str) -> SessionInfo:
        """What a session is, running or paused, without waking it."""
        found = await self.session_state(session_id, owner)
        if isinstance(found, SessionRecord):
            return self.paused_info(found)
        session = await self.sessions.get(session_id, owner)
        return await self._shared_idle(session, self.info(session))

    async def _shared_idle(self, session: Session, info: SessionInfo) -> SessionInfo:
        """A shared session's idle expiry as its sandbox counts it for every replica (this
        replica's own clock misses the calls made through the others)."""
        shared = inner(session.sandbox)
        if not isinstance(shared, SharedSandbox):
            return info
        try:
            idle_s, in_flight = await shared.activity()
        except SandboxError:  # lost: the next call that needs it says so
            return info
        timeout = session.idle_timeout_s or self.settings.idle_timeout_s
        left = timeout if in_flight else max(0.0, timeout - idle_s)
        return info.model_copy(update={"idle_expires_in_s": left})

    def list_sessions(self, owner: str) -> list[Session]:
        return self.sessions.list(owner)

    def list_paused(self, owner: str | None) -> list[SessionRecord]:
        """The owner's paused sessions; None: every owner's (a front finding its own records
        again when it starts)."""
        return self.store.sessions(owner=owner, state="paused")

    async def session_infos(self, owner: str) -> list[SessionInfo]:
        """Every session of the owner's, running and paused (in cluster mode: those every
        replica serves, from the shared store), the store read off the event loop."""
        return [info for _, info in await self.owned_session_infos(owner)]

    async def owned_session_infos(self, owner: str | None) -> list[tuple[str, SessionInfo]]:
        """(owner, info) of each session `session_infos` lists; None: every owner's (an admin's
        view in the console, polled every few seconds). Wakes nothing. The store is read in a
        thread (Redis may take up to its timeout), then the sessions in memory on the loop."""
        records = await asyncio.to_thread(self._listed_records, owner)
        return self._owned_infos(owner, records)

    async def owned_session_info(
        self, owner: str | None, session_id: str
    ) -> tuple[str, SessionInfo] | None:
        """(owner, info) of one session `owned_session_infos` would list, or None; its record
        read off the loop, and only when it is not live here."""
        found = self._live_info(owner, session_id)
        if found is not None or not session_id.startswith("s-"):
            return found
        record = await asyncio.to_thread(self.store.get_session, session_id)
        found = self._live_info(owner, session_id)  # resumed here while the store answered
        if found is not None or record is None or owner not in (None, record.owner):
            return found
        if record.state == "paused":
            return record.owner, self.paused_info(record)
        if self._shared is not None and record.state == "running":  # another replica's
            return record.owner, self.running_info(record)
        return None

    def _live_info(self, owner: str | None, session_id: str) -> tuple[str, SessionInfo] | None:
        live = self.sessions.live(session_id)
        if live is None or owner not in (None, live.owner):
            return None
        return live.owner, self.info(live)

    def _listed_records(self, owner: str | None) -> list[SessionRecord]:
        """The records a listing shows beside the sessions live here: paused ones and, in
        cluster mode, those running on any replica (blocking: the store is read)."""
        running = (
            self._shared.sessions(owner=owner, state="running") if self._shared is not None else []
        )
        return running + self.list_paused(owner)

    def _owned_infos(
        self, owner: str | None, records: list[SessionRecord]
    ) -> list[tuple[str, SessionInfo]]:
        """The live sessions (read now, on the loop) first, then the records of the others."""
        live = self.sessions.all() if owner is None else self.list_sessions(owner)
        found = [(x.owner, self.info(x)) for x in live]
        held = {x.id for x in live}
        for record in records:
            if record.id in held:  # live here (resumed while the store answered), or listed
                continue
            held.add(record.id)
            paused = record.state == "paused"
            info = self.paused_info(record) if paused else self.running_info(record)
            found.append((record.owner, info))
        return found

    async def end_session(self, session_id: str, owner: str) -> None:
        """End a session and its sandbox, running or paused; its kept outputs and paused state
        go with it."""
        async with self._lock_of(session_id):
            record = self._paused_record(session_id, owner)
            if record is None or self.sessions.live(session_id) is not None:
                await self.sessions.delete(session_id, owner)
                return
            await self._delete_paused(record, "was deleted")

    async def _delete_paused(self, record: SessionRecord, why: str) -> None:
        await self._forget_record(record.id)
        self.sessions.remember_ended(record.id, record.owner, why)
        self._audit_ended(record.id, record.owner, why)
        await asyncio.to_thread(self.outputs.drop, record.id)

    # --- pause, resume, snapshots (docs/persistence.md)
    async def pause_session(self, session_id: str, owner: str) -> SessionInfo:
        """Save a session's variables and files and stop its sandbox: it holds no process until
        the next call (or `resume_session`) wakes it. Pausing a paused session changes nothing.
        SessionBusy while it runs code."""
        async with self._lock_of(session_id):
            record = self._paused_record(session_id, owner)
            if record is not None and self.sessions.live(session_id) is None:
                return self.paused_info(record)
            session = await self.sessions.get(session_id, owner)
            if session.backend in SHARED_BACKENDS:
                raise PauseUnsupported(session.backend)
            if session.busy:
                raise SessionBusy(
                    "the session is running code: wait for it, or interrupt it, then pause"
                )
            return self.paused_info(await self._pause(session))

    async def _pause(self, session: Session) -> SessionRecord:
        """Under the session's lock: save, then stop. If the save fails, it keeps running."""
        paused = self.store.count_sessions(session.owner, "paused")
        limit = self.settings.max_paused_sessions_per_key
        if paused >= limit:
            raise SavedStateQuotaReached(
                f"this API key keeps its maximum of {limit} paused sessions; delete one first"
            )
        executions = session.executions
        saved: SnapshotRecord | None = None
        suspended = await session.sandbox.suspend()  # the engine's own pause, where it has one
        if suspended is None:
            saved = await self.saved.save(session, "paused")
            if session.busy or session.executions != executions:  # used while it was saved
                self.store.delete_snapshot(saved.id)
                raise SessionBusy("the session ran code while it was being paused; pause it again")
        earlier = self.store.get_session(session.id)  # a paused state left by a failed pause
        if (
            earlier is not None
            and earlier.saved_state
            and earlier.saved_state != (saved.id if saved else None)
        ):
            self.store.delete_snapshot(earlier.saved_state)
        record = self._record_of(session)
        record.state, record.state_since = "paused", time.time()
        record.saved_state, record.suspended, record.sandbox_id = (
            saved.id if saved else None,
            suspended,
            None,
        )
        record.notice = session.notice
        self.store.put_session(record)
        await self._close_channels(session.id)
        await self.sessions.release(session.id)
        METRICS.sessions_paused.inc()
        self.audit.record(
            audited.SESSION_PAUSED,
            owner=session.owner,
            session_id=session.id,
            details={"saved_bytes": saved.bytes if saved else None, "suspended": bool(suspended)},
        )
        log.info(
            "session %s paused (%s)",
            session.id,
            f"{saved.bytes} bytes saved" if saved else f"suspended by its backend as {suspended}",
        )
        return record

    async def resume_session(self, session_id: str, owner: str) -> ResumeInfo:
        """Wake a paused session now (a running one is left as it is)."""
        async with self._lock_of(session_id):
            record = self._paused_record(session_id, owner)
            if record is None or self.sessions.live(session_id) is not None:
                session = await self.sessions.get(session_id, owner)
                return ResumeInfo(session=self.info(session))
            session = await self._resume(record)
            return ResumeInfo(session=self.info(session), notice=session.notice)

    async def _resume(self, record: SessionRecord) -> Session:
        """Under the session's lock: a new sandbox, its state brought back into it. If that
        fails, the session stays paused and nothing is lost (ResumeFailed)."""
        saved = self.store.get_snapshot(record.saved_state) if record.saved_state else None
        spec = record.spec.model_copy(deep=True)
        notices: list[str] = []
        beyond = spec.network.beyond(self.settings.network_ceiling)
        if beyond:  # the operator lowered the ceiling while it was paused
            spec.network = NO_NETWORK
            notices.append(f"its network is now none: {beyond} (the operator's ceiling changed)")
        with self._enforcing(record.owner, record.id) as who:  # its key's policy may have too
            spec, changed = policy_checks.fit_resumed(
                who, record.backend, spec, default_image=self.settings.docker_image
            )
            notices += changed
        async with self._session_slot(record.owner):
            session = await self.sessions.create(
                record.owner,
                backend=record.backend,
                spec=spec,
                session_id=record.id,
                wake=record.suspended,
            )
        session.created_at, session.executions = record.created_at, record.executions
        session.idle_timeout_s, session.on_idle = record.idle_timeout_s, record.on_idle
        session.labels = dict(record.labels)
        try:
            await self.egress.open(session)
            tools: dict[str, HostTool] = {}
            try:
                tools = self.tools.select(record.tools)
            except UnknownTools as exc:
                notices.append(f"its host tools are gone: {exc}")
            if tools:
                await self._open_channel(session, tools)
            if saved is not None:
                restored = await self.saved.restore(session, saved)
                notices.append(restored.notice)
            elif record.suspended is not None:
                notices.append("its whole sandbox was paused and resumed by its backend")
        except BaseException as exc:
            await self._close_channels(session.id)
            if record.suspended is not None:  # paused again as it was, not killed
                with contextlib.suppress(Exception):
                    record.suspended = await session.sandbox.suspend() or record.suspended
            await self.sessions.release(session.id)
            if isinstance(exc, Exception):
                log.exception("session %s could not be resumed", record.id)
                raise ResumeFailed(
                    f"session {record.id} could not be resumed ({exc}); it stays paused, with "
                    "nothing lost: try again"
                ) from None
            raise
        session.notice = pending_notice(record.notice, notices)
        session.state_lost = record.state_lost
        self.store.put_session(self._record_of(session))
        if saved is not None:
            self.store.delete_snapshot(saved.id)
        METRICS.sessions_resumed.inc()
        self.audit.record(audited.SESSION_RESUMED, owner=record.owner, session_id=record.id)
        log.info("session %s resumed", record.id)
        return session

    async def _expired(self, session: Session, why: str) -> None:
        """The reaper's verdict: paused (auto-pause), or ended when that is off or fails."""
        if session.on_idle != "pause" or self.settings.idle_action != "pause":
            await self.sessions.end(session.id, why)
            return
        async with self._lock_of(session.id):
            if self.sessions.live(session.id) is not session or session.busy:
                return
            if self.sessions.overdue(session) is None:  # used while the lock was awaited
                return
            try:
                await self._pause(session)
            except Exception as exc:
                log.warning("session %s could not be paused (%s): ending it", session.id, exc)
                await self.sessions.end(session.id, f"{why}; it could not be paused ({exc})")

    async def _pause_all(self) -> None:
        """On shutdown: pause what auto-pause would, all at once, so a restart finds it whole;
        what cannot be paused in time ends with the rest."""
        s = self.settings
        if self._store is None or not s.pause_on_shutdown or s.idle_action != "pause":
            return
        due = [x for x in self.sessions.all() if x.on_idle == "pause"]

        async def pause(session: Session) -> None:
            async with self._lock_of(session.id):
                if self.sessions.live(session.id) is not session:
                    return
                try:
                    await asyncio.wait_for(self._pause(session), s.shutdown_pause_timeout_s)
                except Exception as exc:  # it ends with the others
                    log.warning("session %s could not be paused at shutdown: %s", session.id, exc)

        await asyncio.gather(*(pause(x) for x in due))

    async def _salvage(self, name: str, backend: Backend) -> None:
        """Before a backend clears what a crash left: keep the files of its sessions (or the
        whole sandbox, where its engine can pause it). Not in cluster mode: the shared store's
        running sessions are the other replicas' (and the cluster's), not a crash's leftovers."""
        if self._shared is not None:
            return
        kept = await self.saved.salvage(name, backend)
        if kept:
            log.info("kept %d sessions of the %s backend from before a restart", kept, backend)

    async def _sweep(self) -> None:
        """Each reaper round: what is kept past its time goes."""
        await self.audit.sweep()  # first: it never raises
        try:
            await self._sweep_revoked()
        except Exception:
            log.exception("ending the sessions of revoked keys failed")
        await self._sweep_paused()

    async def _sweep_revoked(self) -> None:
        """End the sessions of revoked keys, running and paused: those this replica runs, the
        shared ones and the paused ones the store has (every replica sweeps: each ends its own;
        a principal with nothing left to end is not asked about again)."""
        revoked = self.principals.revoked()
        why = "ended: its key was revoked"
        for session in [x for x in self.sessions.all() if x.owner in revoked]:
            log.info("session %s %s", session.id, why)
            await self.sessions.end(session.id, why)
        for owner in revoked.keys() - self._revoked_ended:
            records = await asyncio.to_thread(self.store.sessions, owner=owner)
            for record in records:
                if record.state == "paused":
                    async with self._lock_of(record.id):
                        if self.sessions.live(record.id) is None:
                            await self._delete_paused(record, why)
                elif record.backend in SHARED_BACKENDS:
                    await self.sessions.end(record.id, why)
            if not records:
                self._revoked_ended.add(owner)

    async def _sweep_paused(self) -> None:
        """Delete paused sessions past their retention, with everything kept for them."""
        retention = self.settings.paused_retention_s
        for listed in self.store.sessions(state="paused", before=time.time() - retention):
            async with self._lock_of(listed.id):
                # Read again under its lock: resumed (and maybe paused afresh) meanwhile?
                record = self.store.get_session(listed.id)
                if record is None or record.state != "paused" or self.sessions.live(record.id):
                    continue
                if record.state_since >= time.time() - retention:
                    continue
                log.info("session %s deleted after %g s paused", record.id, retention)
                await self._delete_paused(record, f"was deleted after {retention:g} s paused")

    async def snapshot_session(self, session: Session, name: str | None = None) -> SnapshotInfo:
        """Save a running session's variables and files under a name, to start sessions from;
        the session runs on."""
        if session.backend in SHARED_BACKENDS:
            raise PauseUnsupported(session.backend)
        async with session.activity():
            record = await self.saved.save(session, "snapshot", name)
        return snapshot_info(record)

    def list_snapshots(self, owner: str) -> list[SnapshotInfo]:
        return [snapshot_info(r) for r in self.saved.list(owner)]

    def get_snapshot(self, owner: str, snapshot_id: str) -> SnapshotInfo:
        return snapshot_info(self.saved.get(owner, snapshot_id))

    def delete_snapshot(self, owner: str, snapshot_id: str) -> None:
        self.saved.delete(owner, snapshot_id)

    async def keepalive(self, session: Session) -> SessionInfo:
        """Mark the session active: its idle expiry starts again (for a shared session, in its
        sandbox, whose activity every replica's reaper reads)."""
        session.touch()
        if isinstance(session.sandbox, LostGuard):
            await session.sandbox.touch()  # a lost one ends here, answered SessionLost
        return self.info(session)

    def status(self, owner: str) -> dict[str, object]:
        return {
            "status": "ok",
            "sessions": len(self.sessions.list(owner)),
            "backends": self.backend_names(),
            "pools": {name: pool.ready for name, pool in self.sessions.pools.items()},
        }

    def backend_names(self) -> list[str]:
        """The backends this service runs sandboxes on."""
        return list(self.sessions.backends)

    async def languages(self, backend: str | None = None) -> list[str]:
        """The languages a new session of `backend` (None: the default one) would have, Python
        first: what the tool's description lists and `GET /v1/languages` answers."""
        name = backend or self.settings.default_backend
        found = self.sessions.backends.get(name)
        if found is None:
            raise BackendNotEnabled(
                f"backend {name!r} is not enabled here; enabled: {', '.join(self.backend_names())}"
            )
        return await found.languages(self.sessions.default_spec())

    async def tool_languages(self, session: Session | None = None) -> list[str]:
        """The languages the tool can offer: a session's, or those of the sessions it starts
        itself. Python alone if the backend cannot say (e.g. its image is missing): the tool's
        description is still given, and a call says what is wrong."""
        if session is not None:
            return self.session_languages(session)
        try:
            return await self.languages()
        except SandboxError as exc:
            log.warning("the default backend's languages are unknown: %s", exc)
            return [PYTHON]

    def network_of(self, session: Session | None) -> NetworkPolicy:
        """A session's network policy; with none, the one a new session gets by default (what
        a tool's model is told of before its session exists)."""
        if session is not None:
            return session.sandbox.spec.network
        return self.settings.network_default

    @staticmethod
    def session_languages(session: Session) -> list[str]:
        """The languages a session's sandbox has, Python first."""
        return session.sandbox.languages

    @staticmethod
    def started_languages(session: Session) -> list[str]:
        """The languages whose kernel a session has started (Python's starts with it)."""
        started = getattr(session.sandbox, "started_languages", None)
        return list(started) if started is not None else [PYTHON]

    # --- code
    def _timeout(self, timeout_s: float | None) -> float:
        s = self.settings
        return min(timeout_s or s.execution_timeout_s, s.max_execution_timeout_s)

    async def execute(
        self,
        session: Session,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        on_event: EventSink | None = None,
        language: str | None = None,
    ) -> ExecutionRecord:
        """Run code in a session's kernel of `language` (None: Python), count it, keep its
        output, and return it with its ids. An unknown language is `UnknownLanguage`, one the
        session's sandbox lacks `LanguageUnavailable`: both name the languages there are."""
        name = check_available(language or PYTHON, session.sandbox.languages)
        with self._enforcing(session.owner, session.id) as who:
            policy_checks.check_language(who, name)
        async with session.activity():
            waited = await self._approval_gate(session, "execution", "execution", code)
            try:
                limit = self._timeout(timeout_s)
                tools = session.id in self._channels  # its calls name it: `origin` in its env
                async with self.approvals.running(session.id, code, limit, shared=tools) as running:
                    execution = await session.sandbox.execute(
                        code,
                        timeout_s=limit,
                        env=running.environment(env) if tools else env,
                        cwd=cwd,
                        on_event=on_event,
                        language=name,
                    )
            except BaseException as exc:  # it broke, or its caller left: recorded all the same
                self._audit_execution(session, code, name, None, None, exc)
                raise
        session.executions += 1
        if session.notice is not None:  # what a resume or a fork brought back, said once
            told = f"{session.notice}. {execution.notice}" if execution.notice else session.notice
            execution = execution.model_copy(
                update={"notice": told, "state_lost": execution.state_lost or session.state_lost}
            )
            session.notice, session.state_lost = None, False
        # `name` is canonical (one of LANGUAGES): the label's values stay bounded.
        METRICS.executions.labels(session.backend, execution.status, name).inc()
        METRICS.execution_seconds.labels(session.backend).observe(execution.duration_s)
        execution_id = await self.outputs.save(session.id, execution)
        self._audit_execution(session, code, name, execution, execution_id)
        return ExecutionRecord(
            **dict(execution),
            session_id=session.id,
            execution_id=execution_id,
            language=name,
            approvals=waited + running.outcomes,
        )

    async def _approval_gate(
        self,
        session: Session,
        kind: Literal["execution", "command"],
        subject: str,
        code: str | None,
    ) -> list[ApprovalOutcome]:
        """Wait for a human when the session's key's policy gates this kind of run
        (approve_executions, approve_commands): [the approval], or [] when it does not;
        ApprovalDenied (403) when denied."""
        policy = self.principals.of(session.owner).policy
        if not (policy.approve_executions if kind == "execution" else policy.approve_commands):
            return []
        gated = await self.approvals.gate(
            kind, session_id=session.id, owner=session.owner, subject=subject, code=code
        )
        return [gated]

    def stream(
        self,
        session: Session,
        code: str,
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        language: str | None = None,
    ) -> AsyncGenerator[OutputEvent | Dropped | Keepalive | Finished[ExecutionRecord]]:
        """`execute`, followed as it happens: its events, keepalives while it is quiet, then
        `Finished` with the record. Closing the generator early interrupts the code."""
        name = check_available(language or PYTHON, session.sandbox.languages)  # refused now, not
        with self._enforcing(session.owner, session.id) as who:  # once it has started
            policy_checks.check_language(who, name)

        def start(sink: EventSink) -> Awaitable[ExecutionRecord]:
            return self.execute(
                session,
                code,
                timeout_s=timeout_s,
                env=env,
                cwd=cwd,
                on_event=sink,
                language=language,
            )

        return follow(start)

    async def interrupt(self, session: Session) -> bool:
        """Stop the running execution, if any; whether one was stopped."""
        session.touch()
        return await session.sandbox.interrupt()

    async def restart(self, session: Session, language: str | None = None) -> SessionInfo:
        """A fresh kernel of `language` (None: every kernel started) in the same sandbox:
        variables go, files stay."""
        name = None if language is None else check_available(language, session.sandbox.languages)
        if name is not None:
            with self._enforcing(session.owner, session.id) as who:
                policy_checks.check_language(who, name)
        async with session.activity():
            await session.sandbox.restart(name)
        return self.info(session)

    # --- processes beside the kernel (commands, background processes, terminals)
    def _process_request(self, request: ProcessRequest) -> ProcessRequest:
        """Within the service's time ceiling: a command may run at most as long as code may."""
        ceiling = self.settings.max_execution_timeout_s
        timeout = min(request.timeout_s or ceiling, ceiling)
        return request.model_copy(update={"timeout_s": timeout})

    async def run_command(
        self,
        session: Session,
        request: ProcessRequest,
        *,
        approvals: list[ApprovalOutcome] | None = None,
        file_transfer: bool = False,
    ) -> CommandResult:
        """Run a command to its end (a caller that leaves kills it); its output within caps.
        `approvals`: given, it gets the approval the command waited for (if its key's policy
        made it wait). `file_transfer`: a front's own file operation done by a command (E2B's
        files outside the workspace), not the key's command: no `commands` rule, no approval."""
        if not file_transfer:
            self.check_commands(session.owner, session.id)
        async with session.activity():
            waited = (
                []
                if file_transfer
                else await self._approval_gate(
                    session, "command", self._command_line(request), None
                )
            )
            if approvals is not None:
                approvals += waited
            line = self._command_line(request)
            tools = session.id in self._channels and not file_transfer
            try:
                async with command_origin(
                    self.approvals, session.id, self._process_request(request), line, tools=tools
                ) as tagged:  # an origin of tool calls while it runs
                    result = await session.sandbox.run_command(tagged)
            except BaseException as exc:  # it could not run, or its caller left
                self._audit_command(session, request, None, exc, file_transfer=file_transfer)
                raise
        METRICS.commands.labels(session.backend, _outcome(result)).inc()
        self._audit_command(session, request, result, file_transfer=file_transfer)
        return result

    async def start_process(
        self, session: Session, request: ProcessRequest, *, file_transfer: bool = False
    ) -> ProcessInfo:
        """Start a process that runs on after this call (a background command or a terminal).
        `file_transfer`: as `run_command`'s."""
        if not file_transfer:
            self.check_commands(session.owner, session.id)
            async with session.activity():  # while it waits for a human, if it must
                await self._approval_gate(session, "command", self._command_line(request), None)
        session.touch()
        process = await start_origin(  # an origin of tool calls until it ends
            self.approvals,
            session.id,
            session.sandbox,
            self._process_request(request),
            self._command_line(request),
            tools=session.id in self._channels and not file_transfer,
        )
        METRICS.processes_started.labels(session.backend).inc()
        info = process.info()
        self.audit.record(
            audited.PROCESS_STARTED,
            owner=session.owner,
            session_id=session.id,
            details={
                "pid": info.pid,
                "command": self._command_line(request),
                "terminal": request.terminal is not None,
                "tag": request.tag,
            }
            | ({"file_transfer": True} if file_transfer else {}),
        )
        return info

    async def list_processes(
        self, session: Session, *, include_ended: bool = False
    ) -> list[ProcessInfo]:
        session.touch()
        return await session.sandbox.processes(include_ended=include_ended)

    async def process_info(self, session: Session, pid: int) -> ProcessInfo:
        session.touch()
        return (await session.sandbox.get_process(pid)).info()

    async def process_events(
        self, session: Session, pid: int, *, replay: bool = False
    ) -> AsyncIterator[ProcessEvent]:
        """A process's output from now on (`replay`: the most recent kept first), then its end;
        a wrong pid raises here, before the stream starts."""
        session.touch()
        return (await session.sandbox.get_process(pid)).events(replay=replay)

    async def wait_process(self, session: Session, pid: int) -> CommandResult:
        async with session.activity():
            return await (await session.sandbox.get_process(pid)).wait()

    async def send_input(
        self, session: Session, pid: int, data: bytes, *, file_transfer: bool = False
    ) -> None:
        """Write to a process's stdin (or its terminal): recorded in the audit log, unless it
        is a front's own file transfer (the file's upload is recorded as one)."""
        session.touch()
        process = await session.sandbox.get_process(pid)
        await process.write_stdin(data)
        if not file_transfer:
            terminal = process.info().terminal
            self.input_audit.typed(session.id, session.owner, pid, data, terminal=terminal)

    async def close_input(self, session: Session, pid: int) -> None:
        session.touch()
        await (await session.sandbox.get_process(pid)).close_stdin()
        self.input_audit.closed(session.id, pid)

    async def signal_process(self, session: Session, pid: int, signum: int) -> None:
        """Send a signal to a process and everything it started (SIGKILL: `kill`)."""
        session.touch()
        await (await session.sandbox.get_process(pid)).signal(signum)

    async def resize_terminal(self, session: Session, pid: int, size: TerminalSize) -> None:
        session.touch()
        await (await session.sandbox.get_process(pid)).resize(size)

    # --- the workspace's files
    def check_upload_size(self, size: int) -> None:
        """Refuse a file over the upload limit: before a session is found or made for it."""
        limit = self.settings.max_upload_bytes
        if size > limit:
            raise FileTooLarge(f"the file is {size} bytes, over the upload limit of {limit}")

    async def upload(self, session: Session, path: str, data: bytes) -> FileInfo:
        self.check_upload_size(len(data))
        async with session.activity():
            info = await session.sandbox.upload(path, data)
        self._audit_file(audited.FILE_UPLOAD, session, path, len(data))
        return info

    async def download(self, session: Session, path: str) -> bytes:
        async with session.activity():
            data = await session.sandbox.download(path, max_bytes=self.settings.max_download_bytes)
        self._audit_file(audited.FILE_DOWNLOAD, session, path, len(data))
        return data

    async def list_files(
        self, session: Session, path: str = "", *, recursive: bool = False
    ) -> list[FileInfo]:
        async with session.activity():
            return await session.sandbox.list_files(path, recursive=recursive)

    async def file_info(self, session: Session, path: str) -> FileInfo | None:
        """What is at `path` (a workspace-relative path, not the root), or None."""
        parent = posixpath.dirname(path)
        for info in await self.list_files(session, parent):
            if info.path == path:
                return info
        return None

    async def remove_file(self, session: Session, path: str) -> None:
        async with session.activity():
            await session.sandbox.remove_file(path)
        self._audit_file(audited.FILE_REMOVE, session, path)

    async def make_directory(self, session: Session, path: str) -> None:
        """Make a directory (and its parents) in the workspace."""
        # The sandbox interface makes directories as a file's parents: write one, remove it.
        placeholder = posixpath.join(path, _PLACEHOLDER)
        async with session.activity():
            await session.sandbox.upload(placeholder, b"")
            await session.sandbox.remove_file(placeholder)
        self._audit_file(audited.FILE_MKDIR, session, path)

    # --- kept outputs
    async def open_kept_execution(self, session: Session, execution_id: str) -> KeptFile:
        return await asyncio.to_thread(self.outputs.open_execution, session.id, execution_id)

    async def kept_execution(self, session: Session, execution_id: str) -> Execution:
        return await asyncio.to_thread(self.outputs.execution, session.id, execution_id)

    def artifact(self, session: Session, artifact_id: str) -> tuple[Path, str]:
        """The file of an image an execution produced, and its MIME type."""
        return self.outputs.artifact(session.id, artifact_id)

    async def kept_output(self, session_id: str, execution_id: str) -> KeptFile:
        """A kept execution's JSON by session id, running or paused: for a reader that has
        checked whose session it is (the console), without waking it."""
        return await asyncio.to_thread(self.outputs.open_execution, session_id, execution_id)

    def kept_artifact(self, session_id: str, artifact_id: str) -> tuple[Path, str]:
        """`artifact`, by session id (as `kept_output`)."""
        return self.outputs.artifact(session_id, artifact_id)

    # --- the code_interpreter tool
    def default_tool_session(self) -> CreateSessionRequest:
        """What a session the tool starts by itself is given (the tools within its key's
        policy, when it is made)."""
        return DefaultToolSession(tools=self.settings.host_tools.session_default)

    async def _tool_session(
        self, owner: str, session_id: str | None, session: Session | None, hint: str
    ) -> Session | ToolOutcome:
        """The session a tool call runs in: the one given, the one named, or a new one; or the
        refusal a model reads (with `hint` when it named one)."""
        if session is not None:
            return session
        try:
            if session_id is not None:
                return await self.get_session(session_id, owner)
            return await self.create_session(owner, self.default_tool_session())
        except PolicyDenied as exc:  # the key's policy: the model reads the rule
            return ToolOutcome.refused(str(exc), POLICY_DENIED)
        except SessionError as exc:
            return ToolOutcome.refused(f"{exc}.{hint if session_id else ''}", "session_error")
        except SandboxError as exc:
            return ToolOutcome.refused(f"could not start a sandbox: {exc}", "session_error")

    async def invoke_tool(
        self,
        owner: str,
        code: str,
        *,
        session_id: str | None = None,
        session: Session | None = None,
        links: OutputLinks | None = None,
        language: str | None = None,
    ) -> ToolOutcome:
        """One call of the `code_interpreter` tool, as every front door makes it: in the session
        named (`session_id`), or given (`session`), or a new one; then rendered for a model.
        Whatever the model can act on (a wrong id, a full quota, a broken sandbox, a language
        there is not) comes back as an error output telling it what to do, never as an
        exception."""
        try:  # a name that is no language at all is refused before a session is made for it
            canonical_language(language)
        except UnknownLanguage as exc:
            return ToolOutcome.refused(f"{exc}. Omit language to run Python.", "invalid_call")
        found = await self._tool_session(owner, session_id, session, HINT_NEW_SESSION_STATE)
        if isinstance(found, ToolOutcome):
            return found
        session = found
        try:
            record = await self.execute(session, code, language=language)
        except LanguageUnavailable as exc:  # the model can pick another: said as its mistake
            return ToolOutcome.refused(str(exc), "invalid_call", session.id)
        except PolicyDenied as exc:  # the key's policy: the model reads the rule
            return ToolOutcome.refused(str(exc), POLICY_DENIED, session.id)
        except ApprovalDenied as exc:  # a human said no (or no one answered): who, and why
            return ToolOutcome.refused(str(exc), APPROVAL_DENIED, session.id)
        except (SessionError, SandboxError) as exc:  # the session ended or broke during the run
            return ToolOutcome.refused(
                f"the session could not run the code: {exc}", "session_error", session.id
            )
        full_output_url, artifact_urls = (
            links(session.id, record) if links is not None else (None, {})
        )
        rendered = render(
            record,
            language=record.language,
            session_id=session.id,
            max_chars=self.settings.tool_output_max_chars,
            full_output_url=full_output_url,
            artifact_urls=artifact_urls,
            approvals=record.approvals,
        )
        return ToolOutcome(session.id, record, rendered, str(record.status))

    def check_shell_tool(self) -> None:
        """Refuse the `run_command` tool unless the operator turned it on."""
        if not self.settings.shell_tool:
            raise ShellToolOff()

    async def invoke_shell_tool(
        self,
        owner: str,
        command: str,
        *,
        session_id: str | None = None,
        session: Session | None = None,
        timeout_s: float | None = None,
    ) -> ToolOutcome:
        """One call of the `run_command` tool: a shell command line in the session named, or
        given, or a new one (the same sessions as `code_interpreter`'s), within the tool's time
        limit; then rendered for a model. As `invoke_tool`: what the model can act on comes
        back as an error output, never as an exception. ShellToolOff when the tool is off."""
        self.check_shell_tool()
        limit = self.settings.execution_timeout_s  # the tool's own, said in its description
        try:  # before a session is made for it
            request = ProcessRequest(command=command, timeout_s=min(timeout_s or limit, limit))
        except ValidationError as exc:  # e.g. a NUL character, which no command line can hold
            problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
            return ToolOutcome.refused(f"the command cannot be run: {problems}", "invalid_call")
        try:  # before a session is made for it
            self.check_commands(owner, session.id if session is not None else session_id)
        except PolicyDenied as exc:
            return ToolOutcome.refused(str(exc), POLICY_DENIED, session_id)
        found = await self._tool_session(owner, session_id, session, HINT_NEW_SESSION)
        if isinstance(found, ToolOutcome):
            return found
        session = found
        waited: list[ApprovalOutcome] = []
        try:
            result = await self.run_command(session, request, approvals=waited)
        except PolicyDenied as exc:
            return ToolOutcome.refused(str(exc), POLICY_DENIED, session.id)
        except ApprovalDenied as exc:
            return ToolOutcome.refused(str(exc), APPROVAL_DENIED, session.id)
        except (SessionError, SandboxError) as exc:  # no processes here, too many, or it broke
            return ToolOutcome.refused(
                f"the session could not run the command: {exc}", "session_error", session.id
            )
        rendered = render_command(
            result,
            session_id=session.id,
            max_chars=self.settings.tool_output_max_chars,
            approvals=waited,
        )
        return ToolOutcome(session.id, None, rendered, _outcome(result))

    def network_report(self, session: Session, most: int = 100) -> NetworkReport:
        """The session's policy, totals and latest `most` connections through its proxy."""
        ledger = self.egress.ledger(session.id)
        report = NetworkReport(
            policy=session.sandbox.spec.network,
            ceiling=self.settings.network_ceiling,
            max_bytes=self.settings.egress_max_bytes_per_session,
        )
        if ledger is None:
            return report
        totals = ledger.totals
        records = list(ledger.records)[-most:] if most > 0 else []
        return report.model_copy(
            update={
                "connections_allowed": totals.connections_allowed,
                "connections_refused": totals.connections_refused,
                "bytes_up": totals.bytes_up,
                "bytes_down": totals.bytes_down,
                "connections": [
                    EgressConnection(
                        time=datetime.fromtimestamp(r.time, UTC),
                        method=r.method,
                        host=r.host,
                        port=r.port,
                        allowed=r.allowed,
                        reason=r.reason,
                        address=r.address,
                        bytes_up=r.bytes_up,
                        bytes_down=r.bytes_down,
                        duration_s=r.duration_s,
                    )
                    for r in records
                ],
            }
        )

    def paused_info(self, record: SessionRecord) -> SessionInfo:
        retention = self.settings.paused_retention_s
        return SessionInfo(
            id=record.id,
            backend=record.backend,
            limits=record.spec.limits,
            created_at=datetime.fromtimestamp(record.created_at, UTC),
            idle_expires_in_s=0.0,
            lifetime_expires_in_s=0.0,
            busy=False,
            executions=record.executions,
            from_pool=False,
            runtime=record.spec.runtime,
            tools=record.tools,
            network=record.spec.network,
            languages=record.languages,
            started_languages=[],
            state="paused",
            paused_at=datetime.fromtimestamp(record.state_since, UTC),
            deleted_in_s=max(0.0, record.state_since + retention - time.time()),
        )

    def running_info(self, record: SessionRecord) -> SessionInfo:
        """A running session another replica made, as its record tells it (cluster mode)."""
        info = self.paused_info(record)
        lifetime = record.created_at + self.settings.max_lifetime_s - time.time()
        return info.model_copy(
            update={
                "state": "running",
                "paused_at": None,
                "deleted_in_s": None,
                "idle_expires_in_s": record.idle_timeout_s or self.settings.idle_timeout_s,
                "lifetime_expires_in_s": max(0.0, lifetime),
                "started_languages": [PYTHON],
            }
        )

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
            runtime=session.sandbox.runtime,
            tools=self.session_tools(session),
            network=session.sandbox.spec.network,
            languages=self.session_languages(session),
            started_languages=self.started_languages(session),
        )


def snapshot_info(record: SnapshotRecord) -> SnapshotInfo:
    return SnapshotInfo(
        id=record.id,
        name=record.name,
        session_id=record.session_id,
        backend=record.backend,
        created_at=datetime.fromtimestamp(record.created_at, UTC),
        bytes=record.bytes,
        variables=record.report.saved_count,
        not_saved=record.report.unsaved,
        files=record.report.files,
    )


_RESUMED = "resumed"
# What each restore says first; the latest one's is the one that holds.
_RESTORED_COUNTS = re.compile(r"\d+ variable\(s\) and \d+ file\(s\) restored\.?")


def pending_notice(earlier: str | None, parts: list[str]) -> str:
    """A resume's notice, with what an earlier one (or a restart, or a fork) said that no
    execution has told yet: each thing once, so repeated pauses and resumes between two
    executions do not make it grow (of the restores' counts, the latest holds)."""
    pieces: list[str] = []
    for whole in ([earlier.removeprefix(f"{_RESUMED}: ")] if earlier else []) + parts:
        for piece in whole.split("; "):
            if piece in ("", _RESUMED) or piece in pieces:
                continue
            if _RESTORED_COUNTS.fullmatch(piece):
                pieces = [p for p in pieces if not _RESTORED_COUNTS.fullmatch(p)]
            pieces.append(piece)
    return f"{_RESUMED}: " + "; ".join(pieces) if pieces else _RESUMED


def _from_snapshot(request: CreateSessionRequest, snapshot: SnapshotRecord) -> CreateSessionRequest:
    """A request starting from a snapshot: its backend, limits, image and runtime unless the
    request says (the image and runtime are checked as if asked for)."""
    update: dict[str, object] = {}
    if request.backend is None:
        update["backend"] = snapshot.backend
    if request.limits is None:
        update["limits"] = LimitsRequest.model_validate(snapshot.spec.limits.model_dump())
    if (request.backend or snapshot.backend) == snapshot.backend:  # its image and runtime too:
        if request.image is None and snapshot.spec.image is not None:  # its modules are there
            update["image"] = snapshot.spec.image
        if request.runtime is None and snapshot.spec.runtime is not None:
            update["runtime"] = snapshot.spec.runtime
    return request.model_copy(update=update)
