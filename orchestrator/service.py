"""The service's core, below HTTP: the one door into a session. A facade over its parts
(orchestrator/service_parts/), each one idea, which it builds, wires, starts and stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from orchestrator.backend_configs import backend_config
from orchestrator.config import Settings
from orchestrator.governance.approvals import Approvals
from orchestrator.host_tools import ToolRegistry
from orchestrator.instance_lock import InstanceLock
from orchestrator.mcp_connections import LocalMcpConnections, McpConnections, SharedMcpConnections
from orchestrator.outputs import KeptOutputs, OutputStore
from orchestrator.service_endpoints import service_endpoints
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.audit_trail import AuditTrail
from orchestrator.service_parts.channels import Channels
from orchestrator.service_parts.deadlines import Deadlines
from orchestrator.service_parts.lifecycle import Lifecycle
from orchestrator.service_parts.pausing import Pauses
from orchestrator.service_parts.persistence import Persistence
from orchestrator.service_parts.ports import Ports
from orchestrator.service_parts.runs import Runs
from orchestrator.service_parts.state_locks import StateLocks
from orchestrator.service_parts.sweeps import Sweeps
from orchestrator.service_parts.views import Views
from orchestrator.service_parts.volumes import Volumes
from orchestrator.service_parts.workspace import Workspace
from orchestrator.session_coordinator import LocalCoordinator
from orchestrator.sessions import SessionCoordinator, SessionManager
from orchestrator.settings_sections import Sections
from orchestrator.vault.vault import Vault, VaultSection
from sandbox import create_backend
from sandbox.backends.base import Backend

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection


log = logging.getLogger(__name__)
SLOW_SHUTDOWN_STEP_S = 10.0  # a shutdown step running longer is named in the log, again each time


class Service:
    """The application layer: the only door into a session. Every front door (REST, the model
    tool, MCP, the E2B front, embedded sessions) parses, calls a part, and formats; activity,
    caps, policy, audit and metrics happen in the parts, once.

    The parts a front calls: `lifecycle` (sessions made, found, listed, paused, resumed,
    ended), `runs` (code, commands, processes), `files` (the workspace's files, kept outputs),
    `persistence` (snapshots), `volumes` (volumes and their files), `views` (answers' shapes,
    languages, status), `admission` (checks a front makes before it has a session, who a key
    is, approvals' answers), `channels`
    (host tools' descriptions), `ports` (connections to servers in sessions), `trail` (the
    audit log's reader), `sweeps.deadlines` (the one sweeper a front's own deadlines run on:
    E2B's sandbox timeouts) and `mcp_connections` (MCP's streamable-HTTP connections). Not the
    settings: fronts are handed what they need when they are built (front_config.py)."""

    def __init__(
        self,
        settings: Settings,
        tools: ToolRegistry | None = None,
        *,
        given_backends: Mapping[str, Backend] | None = None,
    ) -> None:
        """`tools`: host tools given in code (those the settings name are added).
        `given_backends`: backends the caller made and will close (by name), used instead of
        making them from the settings (an embedded session's own)."""
        self._settings = settings  # cut into the parts' sections: no part holds it whole
        cut = Sections.of(settings, service_endpoints(settings))
        shared = _shared_store(settings)
        outputs = _kept_outputs(settings, shared)
        self._outputs = outputs
        # MCP's streamable-HTTP connections: shared in a cluster, so any replica continues one.
        self.mcp_connections = _mcp_connections(settings, shared)
        self._sessions = _session_manager(settings, cut, shared, given_backends, self)
        sessions = self._sessions
        self.trail = AuditTrail(cut.audit, principal_of=lambda owner: self.admission.who(owner))
        # Keys' secrets, bound into their sessions' egress proxies (docs/secrets.md).
        self.vault = Vault(_vault_section(settings), self.trail.secret_event, shared)
        # Humans who approve risky calls (docs/governance.md); asks the stores start() opens.
        self._approvals = Approvals(
            cut.approvals,
            lambda: self.persistence.governance.approvals,
            principal_of=lambda owner: self.admission.who(owner),
            audit=self.trail.log,
            origins_of=lambda: self.persistence.governance.origins,  # a cluster's: shared
        )
        self.admission = Admission(cut.admission, cut.auth, sessions, self.trail, self._approvals)
        self.channels = Channels(
            cut.channels,
            cut.egress,
            tools if tools is not None else ToolRegistry(),
            self.admission,
            self._approvals,
            self.trail,
            vault=self.vault,
        )
        self.views = Views(cut.views, sessions, self.channels)
        self.persistence = Persistence(cut.storage, sessions.backends, self.admission, shared)
        self.files = Workspace(cut.admission, self.admission, self.trail, outputs)
        self.volumes = Volumes(cut.volumes, self.admission, self.trail)
        self.runs = Runs(
            self.admission, self._approvals, self.channels, self.trail, outputs, self.views
        )
        locks = StateLocks(shared)
        pauses = Pauses(
            cut.expiry,
            sessions,
            self.admission,
            self.channels,
            self.persistence,
            self.trail,
            outputs,
            self.volumes,
        )
        self.sweeps = Sweeps(
            cut.expiry, sessions, self.admission, self.persistence, self.trail, pauses, locks
        )
        self.ports = Ports(
            cut.ports,
            sessions,
            self.trail,
            wake=lambda session_id, owner: self.lifecycle.get(session_id, owner),
            state=lambda session_id, owner: self.lifecycle.state(session_id, owner),
        )
        self.lifecycle = Lifecycle(
            cut.expiry,
            sessions,
            admission=self.admission,
            approvals=self._approvals,
            channels=self.channels,
            persistence=self.persistence,
            trail=self.trail,
            views=self.views,
            workspace=self.files,
            pauses=pauses,
            locks=locks,
            outputs=outputs,
            ports=self.ports,
            volumes=self.volumes,
        )
        self.volumes.wire(state=self.lifecycle.state, record_of=self.persistence.get)
        self.deadlines = Deadlines(self.lifecycle, self.sweeps)
        self._instance_lock: InstanceLock | None = None  # held from start to close

    async def start(self) -> None:
        # First of all: a second instance on this state dir stops here, before it clears
        # anything that belongs to the live one.
        s = self._settings
        self._instance_lock = InstanceLock.acquire(s.state_dir, s.orchestrator_id)
        try:
            self._outputs.clear()
            await self.persistence.start()
            self.trail.log.start(self.persistence.governance.audit)
            await self.admission.start(self.persistence.governance.principals)
            await self.volumes.start()  # before a paused session may resume with its volumes
            await self.vault.start()  # before any session may ask for its secrets
            await self.channels.start()
            await self._sessions.start()
        except BaseException:  # what did start (MCP tool servers, backends) is stopped
            await self.close()
            raise

    async def close(self) -> None:
        steps: tuple[tuple[str, Callable[[], Awaitable[None]]], ...] = (
            ("pausing what auto-pause would", self.sweeps.pause_all),
            ("ending the sessions held here", self._sessions.close),
            ("closing host tools' channels and relays", self.channels.close),
            ("closing approvals", self._approvals.close),
            ("writing the audit log", self.trail.close),  # after the sessions' ends
            ("closing admission", self.admission.close),
            ("stopping the host tools", self.channels.close_tools),
            ("unmounting volumes", self.volumes.close),
            ("closing the vault", self.vault.close),
            ("closing the stores", self.persistence.close),
            ("finishing kept outputs' writes", self._outputs.close),
        )
        try:
            for what, step in steps:
                await _named_if_slow(what, step())
        finally:  # last: nothing of this instance is left running
            if self._instance_lock is not None:
                self._instance_lock.release()
                self._instance_lock = None


def _shared_store(settings: Settings) -> RedisConnection | None:
    """Cluster mode (docs/cluster.md): the Redis every replica shares; None on one machine."""
    if settings.store_url is None:
        return None
    from orchestrator.state_store.redis_connection import RedisConnection  # [cluster] extra's

    return RedisConnection(
        settings.store_url.get_secret_value(),
        prefix=settings.store_prefix,
        timeout_s=settings.store_timeout_s,
        allow_unauthenticated=settings.store_allow_unauthenticated,
    )


def _vault_section(settings: Settings) -> VaultSection:
    key = settings.vault_key.get_secret_value() if settings.vault_key is not None else None
    return VaultSection(
        state_dir=settings.state_dir,
        key=key,
        ca_cert_file=settings.vault_ca_cert_file,
        ca_key_file=settings.vault_ca_key_file,
        max_secrets_per_key=settings.vault_max_secrets_per_key,
        clustered=settings.store_url is not None,
    )


def _kept_outputs(settings: Settings, shared: RedisConnection | None) -> KeptOutputs:
    """On this machine's disk; in cluster mode, in the shared store (any replica reads them)."""
    quotas = {
        "max_bytes_per_session": settings.outputs_max_bytes_per_session,
        "max_bytes_total": settings.outputs_max_bytes_total,
    }
    if shared is None:
        return OutputStore(settings.state_dir / "outputs", **quotas)
    from orchestrator.shared_outputs import SharedOutputStore  # the [cluster] extra's Redis

    return SharedOutputStore(shared, **quotas)


def _mcp_connections(settings: Settings, shared: RedisConnection | None) -> McpConnections:
    """Kept while a connection may live: idle, or running its longest call."""
    keep_s = settings.mcp_idle_timeout_s + settings.max_execution_timeout_s
    if shared is None:
        return LocalMcpConnections(keep_s)
    return SharedMcpConnections(shared, keep_s)


def _session_manager(
    settings: Settings,
    cut: Sections,
    shared: RedisConnection | None,
    given_backends: Mapping[str, Backend] | None,
    service: Service,
) -> SessionManager:
    """The session table, telling the service's parts (made after it) what happens to its
    sessions: each end, expiry, reaper round, crash left-over and (cluster mode) attachment."""
    coordinator: SessionCoordinator = LocalCoordinator()
    if shared is not None:
        from orchestrator.cluster.coordinator import ClusterCoordinator  # the [cluster] extra's

        coordinator = ClusterCoordinator(
            cut.cluster,
            shared,
            on_attach=lambda session, record: service.channels.attached(session, record),
            on_idle=lambda record, why: service.sweeps.idle_shared(record, why),
        )
    return SessionManager(
        cut.sessions,
        make_backend=lambda name, spec: create_backend(
            name, **backend_config(settings, name, spec)
        ),
        on_end=lambda session_id: service.lifecycle.ended(session_id),
        given_backends=given_backends,
        on_expiry=lambda session, why: service.sweeps.expired(session, why),
        before_cleanup=lambda name, backend: service.persistence.salvage(name, backend),
        on_sweep=lambda: service.sweeps.sweep(),
        coordinator=coordinator,
    )


async def _named_if_slow(what: str, step: Awaitable[None]) -> None:
    """Await a shutdown step; one that runs past SLOW_SHUTDOWN_STEP_S is named in the log (and
    again after as long each time), so a shutdown that hangs says where."""
    task = asyncio.ensure_future(step)
    waited = 0.0
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=SLOW_SHUTDOWN_STEP_S)
            if done:
                return task.result()
            waited += SLOW_SHUTDOWN_STEP_S
            log.warning("shutdown: still %s after %g s", what, waited)
    finally:
        task.cancel()  # done already, or its caller left: nothing of it runs on
