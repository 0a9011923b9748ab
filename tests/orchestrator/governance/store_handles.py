"""A test's handle on a store as a service, the CLI or a replica opens it: session records and
governance's stores on one database (orchestrator/service_parts/stores.py), by name."""

from __future__ import annotations

import threading
from pathlib import Path

from orchestrator.config import Settings
from orchestrator.governance.approvals import Approvals
from orchestrator.governance.policy import Principal
from orchestrator.service_parts.stores import OpenedStores, open_local, open_shared
from orchestrator.settings_sections import ApprovalSection
from orchestrator.state_store import SqliteStore
from orchestrator.state_store.redis_connection import RedisConnection


class StoreHandle:
    """`records`, and governance's `approvals`, `audit`, `principals` and `origins`."""

    def __init__(self, opened: OpenedStores, connection: RedisConnection | None = None) -> None:
        self.opened = opened
        self.records = opened.records
        self.approvals = opened.governance.approvals
        self.audit = opened.governance.audit
        self.principals = opened.governance.principals
        self.origins = opened.governance.origins
        self._connection = connection

    @property
    def lock(self) -> threading.Lock:
        """The SQLite connection's lock (a local store's only)."""
        assert isinstance(self.records, SqliteStore)
        return self.records.database.lock

    @property
    def connection(self) -> RedisConnection:
        """The Redis connection (a shared store's only)."""
        assert self._connection is not None
        return self._connection

    async def close(self) -> None:
        await self.opened.close()


def local_store(state_dir: Path) -> StoreHandle:
    return StoreHandle(open_local(state_dir))


def shared_store(url: str, *, prefix: str = "cir", snapshots_dir: Path) -> StoreHandle:
    connection = RedisConnection(url, prefix=prefix)
    return StoreHandle(open_shared(connection, snapshots_dir=snapshots_dir), connection)


def replica_approvals(store: StoreHandle, settings: Settings, principal: Principal) -> Approvals:
    """`Approvals` as a replica of a cluster holds it: on the shared store's requests and its
    calls' origins; every key is `principal`."""
    return Approvals(
        ApprovalSection.of(settings),
        lambda: store.approvals,
        principal_of=lambda _: principal,
        origins_of=lambda: store.origins,
    )
