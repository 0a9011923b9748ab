"""The egress proxies of the service's sessions: one per session whose policy gives it a
network, started when the session is made and stopped when it ends. The proxy itself is in
orchestrator/egress/; this is where it meets the service's settings, metrics and log."""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Callable

from orchestrator.config import Settings
from orchestrator.egress import EgressLedger, EgressProxy, EgressRecord, EgressSettings
from orchestrator.egress.slots import ConnectionSlots
from orchestrator.metrics import METRICS
from orchestrator.sessions import Session

log = logging.getLogger(__name__)
# Each connection is a line of the service's log even when the service logs only warnings
# (docs/network.md); an operator's own logging configuration may still change it.
log.setLevel(logging.INFO)


def egress_settings(settings: Settings) -> EgressSettings:
    return EgressSettings(
        private_hosts=frozenset(settings.egress_private_hosts),
        resolve_overrides={n: tuple(a) for n, a in settings.egress_resolve.items()},
        max_bytes_per_session=settings.egress_max_bytes_per_session,
        max_connections_per_session=settings.egress_max_connections_per_session,
    )


def _raise_descriptor_limit() -> None:
    """Let the service use every descriptor it is allowed: each egress connection holds two,
    and the soft limit is often far below the hard one (1024 under systemd)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class SessionEgress:
    """Each session's proxy and ledger, by session id."""

    def __init__(
        self,
        settings: Settings,
        on_connection: Callable[[Session, EgressRecord], None] | None = None,
    ) -> None:
        """`on_connection`: told of each connection as it ends (the audit log); it must not
        block or raise."""
        self.settings = settings
        self._on_connection = on_connection
        self._egress = egress_settings(settings)
        self._slots = ConnectionSlots(settings.egress_max_connections_total)
        if settings.network_ceiling.enabled:
            _raise_descriptor_limit()
        self._proxies: dict[str, EgressProxy] = {}
        self._ledgers: dict[str, EgressLedger] = {}

    async def open(self, session: Session) -> None:
        """Start the session's proxy on its sandbox's egress socket, if it has one."""
        channel = session.sandbox.egress_channel
        if channel is None:
            return
        backend = session.backend

        def record(entry: EgressRecord) -> None:
            decision = "allowed" if entry.allowed else "refused"
            METRICS.egress_connections.labels(backend, decision).inc()
            METRICS.egress_bytes.labels(backend, "up").inc(entry.bytes_up)
            METRICS.egress_bytes.labels(backend, "down").inc(entry.bytes_down)
            log.info(
                "egress session=%s %s %s:%d %s address=%s up=%d down=%d: %s",
                session.id,
                entry.method or "-",
                entry.host or "-",
                entry.port,
                decision,
                entry.address or "-",
                entry.bytes_up,
                entry.bytes_down,
                entry.reason,
            )
            if self._on_connection is not None:
                self._on_connection(session, entry)

        ledger = EgressLedger(session.id, on_record=record)
        proxy = EgressProxy(
            policy=session.sandbox.spec.network,
            ceiling=self.settings.network_ceiling,
            settings=self._egress,
            ledger=ledger,
            slots=self._slots,
        )
        await proxy.start(
            channel.socket_path,
            peer_uid=channel.peer.uid,
            peer_gid=channel.peer_gid,
            peer_program=channel.peer.program,
        )
        self._proxies[session.id] = proxy
        self._ledgers[session.id] = ledger

    def ledger(self, session_id: str) -> EgressLedger | None:
        return self._ledgers.get(session_id)

    async def close(self, session_id: str) -> None:
        proxy = self._proxies.pop(session_id, None)
        self._ledgers.pop(session_id, None)
        if proxy is not None:
            await proxy.close()

    async def close_all(self) -> None:
        for session_id in list(self._proxies):
            await self.close(session_id)
