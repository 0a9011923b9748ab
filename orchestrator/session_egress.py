"""The egress proxies of the service's sessions: one per session whose policy gives it a
network, started when the session is made and stopped when it ends. The proxy itself is in
sandbox/egress/; this is where it meets the service's settings, metrics and log. A sandbox on
another machine (a Ray node) runs its proxy there: it is opened with the same ceiling,
settings and shared caps (counted there for the whole cluster), and its records are taken here
(orchestrator/cluster/egress_relay.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from orchestrator.cluster.egress_relay import EgressRelays
from orchestrator.cluster.shared import RelayedEgress
from orchestrator.metrics import METRICS
from orchestrator.sessions import Session
from orchestrator.settings_sections import EgressSection
from orchestrator.vault.vault import SessionSecrets, Vault
from sandbox import Sandbox
from sandbox.descriptors import raise_descriptor_limit
from sandbox.egress import EgressLedger, EgressProxy, EgressRecord, EgressSettings
from sandbox.egress.outbox import EgressReport
from sandbox.egress.settings import ServiceEndpoint
from sandbox.egress.slots import ConnectionSlots, SharedCaps, key_full, total_full

log = logging.getLogger(__name__)
# Each connection is a line of the service's log even when the service logs only warnings
# (docs/network.md); an operator's own logging configuration may still change it.
log.setLevel(logging.INFO)


def egress_settings(
    settings: EgressSection, refused_endpoints: Sequence[ServiceEndpoint] = ()
) -> EgressSettings:
    return EgressSettings(
        private_hosts=frozenset(settings.egress_private_hosts),
        refused_endpoints=tuple(refused_endpoints),
        resolve_overrides={n: tuple(a) for n, a in settings.egress_resolve.items()},
        max_bytes_per_session=settings.egress_max_bytes_per_session,
        max_connections_per_session=settings.egress_max_connections_per_session,
        upstream_ca_file=settings.egress_upstream_ca_file,
        inspected_ports=frozenset(settings.egress_inspected_ports),
    )


class SessionEgress:
    """Each session's proxy and ledger, by session id."""

    def __init__(
        self,
        settings: EgressSection,
        vault: Vault,
        on_connection: Callable[[Session, EgressRecord], None] | None = None,
        refused_endpoints: Sequence[ServiceEndpoint] | None = None,
    ) -> None:
        """`on_connection`: told of each connection as it ends (the audit log); it must not
        block or raise. `refused_endpoints`: what no sandbox may reach (by default the
        service's API and store: the section's `service_endpoints`). `vault`: where the
        secrets of sessions that ask for some are bound from (orchestrator/vault/)."""
        self.settings = settings
        self._vault = vault
        self._on_connection = on_connection
        if refused_endpoints is None:
            refused_endpoints = settings.service_endpoints
        self._egress = egress_settings(settings, refused_endpoints)
        total = settings.egress_max_connections_total
        self._slots = ConnectionSlots(total, total_full(total))
        # Each key's sessions share a cap: one key cannot hold the whole service's. Kept while
        # the key has a proxy open, with the count of those.
        self._key_slots: dict[str, tuple[ConnectionSlots, int]] = {}
        self._owners: dict[str, str] = {}  # session id -> its key's owner id
        if settings.network_ceiling.enabled:
            raise_descriptor_limit()  # each egress connection holds two
        self._proxies: dict[str, EgressProxy] = {}
        self._ledgers: dict[str, EgressLedger] = {}
        # Sessions whose proxy runs beside their sandbox elsewhere: their records taken here.
        self._relays = EgressRelays()

    async def open(self, session: Session) -> None:
        """Start the session's proxy on its sandbox's egress socket, if it has one; for a
        sandbox whose proxy runs beside it on another machine, start that one (or find it
        started) and take its records here."""
        channel = session.sandbox.egress_channel
        if channel is None:
            relayed = _relayed(session)
            if relayed is not None:
                s = self.settings
                caps = SharedCaps(
                    session.owner, s.egress_max_connections_per_key, s.egress_max_connections_total
                )
                if await relayed.open_egress(s.network_ceiling, self._egress, caps):
                    await self._relay(session, relayed)
            return
        secrets = await self._secrets(session, channel.path)
        ledger = EgressLedger(session.id, on_record=lambda e: self._recorded(session, e))
        proxy = EgressProxy(
            policy=session.sandbox.spec.network,
            ceiling=self.settings.network_ceiling,
            settings=self._egress,
            ledger=ledger,
            slots=(self._hold_key_slots(session), self._slots),
            credentials=secrets.bindings if secrets is not None else None,
            interceptor=secrets.interceptor if secrets is not None else None,
        )
        try:
            await proxy.start(
                channel.socket_path,
                peer_uid=channel.peer.uid,
                peer_gid=channel.peer_gid,
                peer_program=channel.peer.program,
            )
        except BaseException:
            self._drop_key_slots(session.id)
            raise
        self._proxies[session.id] = proxy
        self._ledgers[session.id] = ledger

    async def _secrets(self, session: Session, directory: Path) -> SessionSecrets | None:
        """The session's secrets bound for its proxy (none asked: None). The files sandboxes
        trust are written where they read them (the egress directory, bound read-only) for
        every session once the vault has its CA, secrets or not: a sandbox forked or restored
        from one that had secrets keeps its variables naming them (SSL_CERT_FILE...), so they
        must name a file. The files are public: the system's CAs and the deployment's."""
        trust = self._vault.trust
        if trust is not None:  # off the event loop: the system's CAs are some 200 KiB
            await asyncio.to_thread(_write_trust_files, directory, trust.files())
        if not session.secrets:
            return None
        return await self._vault.for_session(session.owner, session.id, session.secrets)

    async def attach(self, session: Session) -> None:
        """A session another replica made, now served here too: its proxy's records taken
        here as well (so they keep coming if that replica goes). Its proxy is that replica's
        to open: one not open yet is polled until it is."""
        relayed = _relayed(session)
        if relayed is not None:
            await self._relay(session, relayed)

    async def _relay(self, session: Session, sandbox: RelayedEgress) -> None:
        await self._relays.start(session.id, sandbox, lambda e: self._recorded(session, e))

    def _recorded(self, session: Session, entry: EgressRecord) -> None:
        """A connection of the session ended: counted, logged, and handed to `on_connection`."""
        backend = session.backend
        decision = "allowed" if entry.allowed else "refused"
        METRICS.egress_connections.labels(backend, decision).inc()
        METRICS.egress_bytes.labels(backend, "up").inc(entry.bytes_up)
        METRICS.egress_bytes.labels(backend, "down").inc(entry.bytes_down)
        log.info("%s", entry.describe(session.id))
        if entry.credentials:
            self._vault.used(session.owner, session.id, entry.host, entry.credentials)
        if self._on_connection is not None:
            self._on_connection(session, entry)

    def _hold_key_slots(self, session: Session) -> ConnectionSlots:
        """The cap the session's key shares among its sessions, made with its first."""
        slots, users = self._key_slots.get(session.owner, (None, 0))
        if slots is None:
            cap = self.settings.egress_max_connections_per_key
            slots = ConnectionSlots(cap, key_full(cap))
        self._key_slots[session.owner] = (slots, users + 1)
        self._owners[session.id] = session.owner
        return slots

    def _drop_key_slots(self, session_id: str) -> None:
        owner = self._owners.pop(session_id, None)
        if owner is None:
            return
        slots, users = self._key_slots[owner]
        if users <= 1:
            del self._key_slots[owner]
        else:
            self._key_slots[owner] = (slots, users - 1)

    async def report(self, session: Session, most: int) -> EgressReport | None:
        """The session's proxy's totals and latest `most` connections; None without one."""
        ledger = self._ledgers.get(session.id)
        if ledger is not None:
            return EgressReport.of(ledger, most)
        relayed = _relayed(session)
        return None if relayed is None else await relayed.egress_report(most)

    def serves_another(self, session_id: str, sandbox: Sandbox) -> bool:
        """Whether the session's records are taken here from a sandbox other than `sandbox`."""
        return self._relays.serves_another(session_id, sandbox)

    async def close(self, session_id: str) -> None:
        await self._relays.stop(session_id)
        proxy = self._proxies.pop(session_id, None)
        self._ledgers.pop(session_id, None)
        if proxy is not None:
            await proxy.close()
        self._drop_key_slots(session_id)

    async def close_all(self) -> None:
        for session_id in list(self._proxies):
            await self.close(session_id)
        await self._relays.close()


def _write_trust_files(directory: Path, files: Sequence[tuple[str, bytes]]) -> None:
    for name, data in files:
        partial = directory / f".{name}.partial"
        partial.write_bytes(data)
        partial.chmod(0o644)  # the sandbox's uid reads it; nobody there may change it
        partial.replace(directory / name)


def _relayed(session: Session) -> RelayedEgress | None:
    """The session's sandbox when its proxy runs beside it on another machine (a Ray node) and
    it has a network; else None."""
    sandbox = session.sandbox
    if isinstance(sandbox, RelayedEgress) and sandbox.spec.network.enabled:
        return sandbox
    return None
