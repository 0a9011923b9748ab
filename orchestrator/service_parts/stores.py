"""The stores a service works through, opened together on one database: session records and
saved states (orchestrator/state_store/), and governance's (orchestrator/governance/stores/).
On one machine they share the state dir's SQLite file; in a cluster, the Redis every replica
shares (which the cluster's coordination store uses too)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.governance.stores import GovernanceStores, redis_stores, sqlite_stores
from orchestrator.state_store.interfaces import StateStore
from orchestrator.state_store.sqlite_db import SqliteDatabase
from orchestrator.state_store.sqlite_store import SqliteStore

if TYPE_CHECKING:
    from orchestrator.state_store.redis_connection import RedisConnection


@dataclass
class OpenedStores:
    records: StateStore
    governance: GovernanceStores
    _close: Callable[[], Awaitable[None]]

    async def close(self) -> None:
        self.governance.close()
        await self.records.close()
        await self._close()


def open_local(state_dir: Path, saved_states: Path | None = None) -> OpenedStores:
    """The state dir's SQLite file (made if missing); saved states' files in `saved_states`
    (by default beside it)."""
    db = SqliteDatabase(state_dir)

    async def close() -> None:
        db.close()

    return OpenedStores(SqliteStore(db, saved_states), sqlite_stores(db), close)


def open_shared(
    connection: RedisConnection, *, snapshots_dir: Path, max_listed: int = 10_000
) -> OpenedStores:
    """The Redis a cluster's replicas share (its connection closed with them)."""
    from orchestrator.state_store.redis_store import RedisStore

    records = RedisStore(connection, snapshots_dir=snapshots_dir, max_listed=max_listed)
    return OpenedStores(records, redis_stores(connection, max_listed=max_listed), connection.close)
