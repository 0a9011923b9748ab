"""Persistence: the service's store (sessions' records, saved states, and what governance keeps
there) and the snapshots it keeps (docs/persistence.md). Every store call of the service's parts
is made here, so the store's interface is met in one place."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from code_interpreter_wire.rest import SnapshotInfo
from orchestrator.saved_states import SavedStates
from orchestrator.service_parts.admission import Admission
from orchestrator.service_parts.stores import OpenedStores, open_local, open_shared
from orchestrator.service_parts.views import snapshot_info
from orchestrator.sessions import Session
from orchestrator.settings_sections import StorageSection
from orchestrator.state_store import SessionRecord, SnapshotRecord, StateStore
from sandbox.backends.base import Backend

if TYPE_CHECKING:
    from orchestrator.governance.stores import GovernanceStores
    from orchestrator.state_store.redis_connection import RedisConnection

log = logging.getLogger(__name__)


def record_of(session: Session, tools: list[str]) -> SessionRecord:
    """What the store keeps of a running session (`tools`: the host tools it was given)."""
    return SessionRecord(
        id=session.id,
        owner=session.owner,
        backend=session.backend,
        spec=session.sandbox.spec,
        tools=tools,
        languages=session.sandbox.languages,
        idle_timeout_s=session.idle_timeout_s,
        on_idle=session.on_idle,
        created_at=session.created_at,
        sandbox_id=session.sandbox.id,
        sandbox_handle=session.sandbox.handle,
        executions=session.executions,
        labels=session.labels,
        ports=session.ports,
        secrets=session.secrets,
    )


class Persistence:
    def __init__(
        self,
        settings: StorageSection,
        backends: Mapping[str, Backend],
        admission: Admission,
        shared: RedisConnection | None,
    ) -> None:
        """`backends`: the session manager's (a paused state its engine kept is discarded
        there); `shared`: the Redis every replica shares (cluster mode), else SQLite in the
        state dir; the stores are opened by `start`."""
        self.settings = settings
        self._backends = backends
        self._admission = admission
        self._shared = shared
        self._stores: OpenedStores | None = None  # opened in start()
        self._saved: SavedStates | None = None

    async def start(self) -> None:
        if self._shared is not None:
            stores = open_shared(self._shared, snapshots_dir=self.settings.saved_states)
        else:
            stores = open_local(self.settings.state_dir, self.settings.saved_states)
        try:
            await stores.records.ping()  # an unreachable store stops the start, saying which
        except BaseException:
            await stores.close()
            raise
        self._stores = stores
        self._saved = SavedStates(self.settings, stores.records, self._shared)
        await self._saved.remove_unrecorded()

    async def close(self) -> None:
        if self._stores is not None:
            await self._stores.close()

    @property
    def started(self) -> bool:
        return self._stores is not None

    @property
    def store(self) -> StateStore:
        if self._stores is None:
            raise RuntimeError("the service is not started")
        return self._stores.records

    @property
    def governance(self) -> GovernanceStores:
        """Governance's stores (approvals, audit, principals, shared origins), on the same
        database as the records."""
        if self._stores is None:
            raise RuntimeError("the service is not started")
        return self._stores.governance

    @property
    def saved(self) -> SavedStates:
        if self._saved is None:
            raise RuntimeError("the service is not started")
        return self._saved

    # --- sessions' records
    async def get(self, session_id: str) -> SessionRecord | None:
        return await self.store.get_session(session_id)

    async def put(self, record: SessionRecord) -> None:
        await self.store.put_session(record)

    async def paused(self, session_id: str, owner: str) -> SessionRecord | None:
        """The owner's paused session of that id, or None."""
        record = await self.store.get_session(session_id) if session_id.startswith("s-") else None
        if record is None or record.owner != owner or record.state != "paused":
            return None
        return record

    @property
    def clustered(self) -> bool:
        """Cluster mode: every replica shares the store (docs/cluster.md)."""
        return self._shared is not None

    async def scan(self, cursor: int, batch: int | None = None) -> tuple[int, list[SessionRecord]]:
        """A bounded piece (`batch`; None: the cluster's reap batch) of the shared store's
        running sessions from `cursor`, and where the next piece starts (cluster mode; on one
        machine, where every record is this service's own: nothing, (0, []))."""
        if not self.store.shared:
            return 0, []
        return await self.store.scan_sessions(cursor, batch or self.settings.cluster_reap_batch)

    async def list_paused(self, owner: str | None) -> list[SessionRecord]:
        """The owner's paused sessions; None: every owner's (a front finding its own records
        again when it starts)."""
        return await self.store.sessions(owner=owner, state="paused")

    async def listed(self, owner: str | None) -> list[SessionRecord]:
        """The records a listing shows beside the sessions live here: paused ones and, in
        cluster mode, those running on any replica."""
        running = (
            await self.store.sessions(owner=owner, state="running") if self.store.shared else []
        )
        return running + await self.list_paused(owner)

    async def of_owner(self, owner: str) -> list[SessionRecord]:
        return await self.store.sessions(owner=owner)

    async def paused_before(self, when: float) -> list[SessionRecord]:
        return await self.store.sessions(state="paused", before=when)

    async def count_paused(self, owner: str) -> int:
        return await self.store.count_sessions(owner, "paused")

    async def set_labels(self, session: Session, before: Mapping[str, str]) -> None:
        """Keep what changed of a session's labels since `before` with its record, if it has
        one (and only while it has: one deleted meanwhile, by another replica even, is never
        brought back); nothing else of the record is written (a pause through another replica
        meanwhile stands), and labels this copy of the session did not change stay as they
        are in the record (another replica's change stands: this copy takes it)."""
        changes: dict[str, str | None] = {
            name: value for name, value in session.labels.items() if before.get(name) != value
        }
        changes |= {name: None for name in before if name not in session.labels}
        merged = await self.store.set_session_labels(session.id, changes)
        if merged is not None:
            session.labels = merged

    async def forget(self, session_id: str) -> None:
        """Delete a session's record and its paused state, if any."""
        record = await self.store.get_session(session_id)
        if record is None:
            return
        if record.saved_state is not None:
            await self.store.delete_snapshot(record.saved_state)
        backend = self._backends.get(record.backend)
        if record.suspended is not None and backend is not None:
            await backend.discard(record.suspended)
        await self.store.delete_session(session_id)

    # --- saved states
    async def saved_state(self, snapshot_id: str) -> SnapshotRecord | None:
        return await self.store.get_snapshot(snapshot_id)

    async def drop_saved_state(self, snapshot_id: str) -> None:
        await self.store.delete_snapshot(snapshot_id)

    @asynccontextmanager
    async def pinned(
        self, owner: str, snapshot_id: str | None
    ) -> AsyncIterator[SnapshotRecord | None]:
        """The owner's snapshot to start a session from (None for None), refused before a
        sandbox is made for it, and kept from deletion until restored."""
        async with self.saved.pinned(owner, snapshot_id) as snapshot:
            yield snapshot

    async def salvage(self, name: str, backend: Backend) -> None:
        """Before a backend clears what a crash left: keep the files of its sessions (or the
        whole sandbox, where its engine can pause it). Not in cluster mode: the shared store's
        running sessions are the other replicas' (and the cluster's), not a crash's leftovers."""
        if self.store.shared:
            return
        kept = await self.saved.salvage(name, backend)
        if kept:
            log.info("kept %d sessions of the %s backend from before a restart", kept, name)

    # --- snapshots (named saved states, to start sessions from)
    async def snapshot(self, session: Session, name: str | None = None) -> SnapshotInfo:
        """Save a running session's variables and files under a name, to start sessions from;
        the session runs on."""
        self._admission.check_snapshot(session)
        async with session.activity():
            record = await self.saved.save(session, "snapshot", name)
        return snapshot_info(record)

    async def list_snapshots(self, owner: str) -> list[SnapshotInfo]:
        return [snapshot_info(r) for r in await self.saved.list(owner)]

    async def get_snapshot(self, owner: str, snapshot_id: str) -> SnapshotInfo:
        return snapshot_info(await self.saved.get(owner, snapshot_id))

    async def delete_snapshot(self, owner: str, snapshot_id: str) -> None:
        await self.saved.delete(owner, snapshot_id)
