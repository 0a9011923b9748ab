"""The store interfaces the service works through. Every method is small, and quick on SQLite;
a store for many replicas implements the same ones."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from orchestrator.state_store.records import (
    SessionRecord,
    SessionState,
    SnapshotKind,
    SnapshotRecord,
)


class SessionStore(ABC):
    @abstractmethod
    def put_session(self, record: SessionRecord) -> None:
        """Insert or replace."""

    @abstractmethod
    def get_session(self, session_id: str) -> SessionRecord | None: ...

    @abstractmethod
    def delete_session(self, session_id: str) -> None: ...

    @abstractmethod
    def sessions(
        self,
        *,
        owner: str | None = None,
        state: SessionState | None = None,
        backend: str | None = None,
        before: float | None = None,
    ) -> list[SessionRecord]:
        """Sessions, filtered; `before`: in their state since before that time."""

    @abstractmethod
    def count_sessions(self, owner: str, state: SessionState) -> int: ...


class SnapshotStore(ABC):
    @abstractmethod
    def files_of(self, snapshot_id: str) -> Path:
        """The directory holding a saved state's files (which may not exist yet)."""

    @abstractmethod
    def put_snapshot(self, record: SnapshotRecord) -> None: ...

    @abstractmethod
    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None: ...

    @abstractmethod
    def delete_snapshot(self, snapshot_id: str) -> None:
        """Remove the record and its files."""

    @abstractmethod
    def snapshots(
        self,
        *,
        owner: str | None = None,
        kind: SnapshotKind | None = None,
        session_id: str | None = None,
    ) -> list[SnapshotRecord]:
        """Newest first."""

    @abstractmethod
    def usage(self, owner: str) -> tuple[int, int]:
        """(named snapshots, bytes of every saved state) the owner holds."""
