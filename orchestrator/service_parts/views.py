"""Views: the shapes the service answers in (a session's info, running or paused, a snapshot's,
a session's network report, the service's status). Nothing here changes anything."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from code_interpreter_wire.errors import BackendUnavailable, SandboxError
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.network_policy import NetworkPolicy
from code_interpreter_wire.rest import EgressConnection, NetworkReport, SessionInfo, SnapshotInfo
from orchestrator.service_parts.channels import Channels
from orchestrator.service_parts.ports import ports_info
from orchestrator.sessions import BackendNotEnabled, Session, SessionManager
from orchestrator.settings_sections import ViewSection
from orchestrator.state_store import SessionRecord, SnapshotRecord
from sandbox.image_labels import template_image

log = logging.getLogger(__name__)


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
        whole_sandbox=record.report.machine,
    )


def session_languages(session: Session) -> list[str]:
    """The languages a session's sandbox has, Python first."""
    return session.sandbox.languages


def started_languages(session: Session) -> list[str]:
    """The languages whose kernel a session has started (Python's starts with it)."""
    started = getattr(session.sandbox, "started_languages", None)
    return list(started) if started is not None else [PYTHON]


class Views:
    def __init__(self, settings: ViewSection, sessions: SessionManager, channels: Channels) -> None:
        self.settings = settings
        self._sessions = sessions
        self._channels = channels

    # --- sessions
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
            calls_in_progress=session.busy,
            executions=session.executions,
            from_pool=session.from_pool,
            runtime=session.sandbox.runtime,
            tools=self._channels.session_tools(session),
            network=session.sandbox.spec.network,
            languages=session_languages(session),
            started_languages=started_languages(session),
            ports=ports_info(session.id, session.ports, s.ports_domain),
            secrets=session.secrets,
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
            ports=ports_info(record.id, record.ports, self.settings.ports_domain),
            secrets=record.secrets,
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

    def record_info(self, record: SessionRecord) -> SessionInfo:
        """A session known by its record only: paused, or running on another replica."""
        return self.paused_info(record) if record.state == "paused" else self.running_info(record)

    session_languages = staticmethod(session_languages)
    started_languages = staticmethod(started_languages)

    def session_tools(self, session: Session) -> list[str]:
        return self._channels.session_tools(session)

    def network_of(self, session: Session | None) -> NetworkPolicy:
        """A session's network policy; with none, the one a new session gets by default (what
        a tool's model is told of before its session exists)."""
        if session is not None:
            return session.sandbox.spec.network
        return self.settings.network_default

    async def network_report(self, session: Session, most: int = 100) -> NetworkReport:
        """The session's policy, totals and latest `most` connections through its proxy."""
        # A node's proxy is asked: a lost one is SessionLost. Reading it is not use: a client
        # watching a session's traffic does not keep it from idling out.
        async with session.reach(active=False):
            found = await self._channels.egress_report(session, most)
        report = NetworkReport(
            policy=session.sandbox.spec.network,
            ceiling=self.settings.network_ceiling,
            max_bytes=self.settings.egress_max_bytes_per_session,
        )
        if found is None:
            return report
        totals, records = found.totals, found.records
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

    # --- the service
    def status(self, owner: str) -> dict[str, object]:
        return {
            "status": "ok",
            "sessions": len(self._sessions.list(owner)),
            "backends": self.backend_names(),
            "pools": {name: pool.ready for name, pool in self._sessions.pools.items()},
        }

    def backend_names(self) -> list[str]:
        """The backends this service runs sandboxes on."""
        return list(self._sessions.backends)

    async def templates(self) -> dict[str, str]:
        """The templates a session may start from, by name: each its image (none unless
        `docker_templates`, and a backend here runs images)."""
        backend = self.image_backend()
        if backend is None or not self.settings.docker_templates:
            return {}
        try:
            names = await self._sessions.backends[backend].templates()
        except BackendUnavailable:  # its engine is away: none to offer now
            return {}
        return {name: template_image(name) for name in names}

    def image_backend(self) -> str | None:
        """The enabled backend that runs the container image a session names, if any."""
        return next((n for n, b in self._sessions.backends.items() if b.capabilities.images), None)

    def tool_output_chars(self) -> int:
        """How much of an output a model tool's answer shows (the rest is linked)."""
        return self.settings.tool_output_max_chars

    def public_url(self) -> str | None:
        """The service's address as its callers reach it (links in answers); None: each
        front answers with the address its request came to."""
        return self.settings.public_url

    def listed_images(self) -> list[str]:
        """The container images the operator lists by name (`docker_images`, else its one
        default image): what a front offers as names (E2B's templates)."""
        return list(self.settings.docker_images) or [self.settings.docker_image]

    def default_backend(self) -> str:
        """The backend a session that names none gets (its key's policy permitting)."""
        return self.settings.default_backend

    async def languages(self, backend: str | None = None) -> list[str]:
        """The languages a new session of `backend` (None: the default one) would have, Python
        first: what the tool's description lists and `GET /v1/languages` answers."""
        name = backend or self.settings.default_backend
        found = self._sessions.backends.get(name)
        if found is None:
            raise BackendNotEnabled(
                f"backend {name!r} is not enabled here; enabled: {', '.join(self.backend_names())}"
            )
        return await found.languages(self._sessions.default_spec())

    async def tool_languages(self, session: Session | None = None) -> list[str]:
        """The languages the tool can offer: a session's, or those of the sessions it starts
        itself. Python alone if the backend cannot say (e.g. its image is missing): the tool's
        description is still given, and a call says what is wrong."""
        if session is not None:
            return session_languages(session)
        try:
            return await self.languages()
        except SandboxError as exc:
            log.warning("the default backend's languages are unknown: %s", exc)
            return [PYTHON]
