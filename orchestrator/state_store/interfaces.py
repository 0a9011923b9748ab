"""The store interfaces the service works through: session records and saved states. Every
method is small and async: SQLite runs it on its database's thread (sqlite_db.py), Redis awaits
the server (redis_connection.py); the event loop waits on neither."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

from orchestrator.state_store.records import (
    SessionRecord,
    SessionState,
    SnapshotKind,
    SnapshotRecord,
)


class SessionStore(ABC):
    # Whether other replicas write these records too (a cluster's shared store): then the
    # running sessions it holds are theirs, not a crash's left-overs, and a record another
    # replica deleted must never be brought back.
    shared: bool = False

    @abstractmethod
    async def put_session(self, record: SessionRecord) -> None:
        """Insert or replace; a record already there keeps its labels (they change only
        through `set_session_labels`, so a pause written from a replica's older copy of the
        session never undoes a front's label set through another)."""

    @abstractmethod
    async def set_session_labels(
        self, session_id: str, changes: Mapping[str, str | None]
    ) -> dict[str, str] | None:
        """Change only the record's labels, if it still exists (never bring back a deleted
        one, never undo a pause written meanwhile): each of `changes` set (None: removed), the
        others as they are (another replica's change stands). The labels now, or None when
        there is no record."""

    @abstractmethod
    async def get_session(self, session_id: str) -> SessionRecord | None: ...

    @abstractmethod
    async def delete_session(self, session_id: str) -> None: ...

    @abstractmethod
    async def sessions(
        self,
        *,
        owner: str | None = None,
        state: SessionState | None = None,
        backend: str | None = None,
        before: float | None = None,
    ) -> list[SessionRecord]:
        """Sessions, filtered; `before`: in their state since before that time."""

    @abstractmethod
    async def count_sessions(self, owner: str, state: SessionState) -> int: ...

    @abstractmethod
    async def scan_sessions(self, cursor: int, count: int) -> tuple[int, list[SessionRecord]]:
        """One step of a walk over the running sessions: (the next cursor, 0 when the walk is
        done; about `count` records). A sweep walks a bounded piece per round this way."""


class SnapshotStore(ABC):
    @abstractmethod
    def files_of(self, snapshot_id: str) -> Path:
        """The directory holding a saved state's files (which may not exist yet)."""

    @abstractmethod
    async def put_snapshot(self, record: SnapshotRecord) -> None: ...

    @abstractmethod
    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None: ...

    @abstractmethod
    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the record and its files."""

    @abstractmethod
    async def snapshots(
        self,
        *,
        owner: str | None = None,
        kind: SnapshotKind | None = None,
        session_id: str | None = None,
    ) -> list[SnapshotRecord]:
        """Newest first."""

    @abstractmethod
    async def usage(self, owner: str) -> tuple[int, int]:
        """(named snapshots, bytes of every saved state) the owner holds."""

    @abstractmethod
    async def orphan_files(self) -> list[Path]:
        """Saved states' directories no record names (a crash between writing and
        recording)."""


class StateStore(SessionStore, SnapshotStore):
    """Both, in one place (a state dir's SQLite file, or the Redis a cluster shares)."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise unless the store answers (and, for a shared one, demands a password)."""

    @abstractmethod
    async def close(self) -> None: ...


def with_changes(labels: Mapping[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    """`labels` with each of `changes` set (None: removed)."""
    merged = dict(labels)
    for name, value in changes.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged
