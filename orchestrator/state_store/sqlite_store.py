"""Both stores in one SQLite file under the state dir, and saved states' files beside it.

Rows hold JSON documents (the records' own schema) plus the columns queries filter on, so a new
field needs no migration. WAL and `synchronous=NORMAL`: a committed row survives a crash of the
service (not of the machine's power), and each write costs well under a millisecond.
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any

from orchestrator.state_store.interfaces import SessionStore, SnapshotStore
from orchestrator.state_store.records import (
    SessionRecord,
    SessionState,
    SnapshotKind,
    SnapshotRecord,
)
from orchestrator.state_store.sqlite_approvals import SqliteApprovals
from orchestrator.state_store.sqlite_audit import SqliteAudit
from orchestrator.state_store.sqlite_principals import SqlitePrincipals

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, backend TEXT NOT NULL, state TEXT NOT NULL,
    state_since REAL NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions (owner, state);
CREATE TABLE IF NOT EXISTS snapshots (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, session_id TEXT NOT NULL,
    created_at REAL NOT NULL, bytes INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS snapshots_by_owner ON snapshots (owner, kind);
CREATE INDEX IF NOT EXISTS snapshots_by_session ON snapshots (session_id);
"""


class SqliteStore(SessionStore, SnapshotStore):
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self._files = state_dir / "snapshots"
        self._files.mkdir(mode=0o700, exist_ok=True)
        self._files.chmod(0o700)
        path = state_dir / "state.db"
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        path.chmod(0o600)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        self.approvals = SqliteApprovals(self._db, self._lock)
        self.audit = SqliteAudit(self._db, self._lock)
        self.principals = SqlitePrincipals(self._db, self._lock)

    def close(self) -> None:
        self.audit.close()  # its own reading connection
        with self._lock:
            self._db.close()

    def _rows(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        with self._lock:
            self._db.execute(sql, args)

    # --- sessions
    def put_session(self, record: SessionRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.owner,
                record.backend,
                record.state,
                record.state_since,
                record.model_dump_json(),
            ),
        )

    def get_session(self, session_id: str) -> SessionRecord | None:
        rows = self._rows("SELECT doc FROM sessions WHERE id = ?", (session_id,))
        return SessionRecord.model_validate_json(rows[0][0]) if rows else None

    def delete_session(self, session_id: str) -> None:
        self._write("DELETE FROM sessions WHERE id = ?", (session_id,))

    def sessions(
        self,
        *,
        owner: str | None = None,
        state: SessionState | None = None,
        backend: str | None = None,
        before: float | None = None,
    ) -> list[SessionRecord]:
        where, args = _filters(owner=owner, state=state, backend=backend)
        if before is not None:
            where.append("state_since < ?")
            args.append(before)
        sql = "SELECT doc FROM sessions" + _where(where) + " ORDER BY state_since"
        return [SessionRecord.model_validate_json(r[0]) for r in self._rows(sql, tuple(args))]

    def count_sessions(self, owner: str, state: SessionState) -> int:
        rows = self._rows(
            "SELECT count(*) FROM sessions WHERE owner = ? AND state = ?", (owner, state)
        )
        return int(rows[0][0])

    # --- snapshots
    def files_of(self, snapshot_id: str) -> Path:
        if not snapshot_id.replace("-", "").isalnum():  # ids are made here; never a path
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return self._files / snapshot_id

    def put_snapshot(self, record: SnapshotRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO snapshots VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                record.id,
                record.owner,
                record.kind,
                record.session_id,
                record.created_at,
                record.bytes,
                record.model_dump_json(),
            ),
        )

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        rows = self._rows("SELECT doc FROM snapshots WHERE id = ?", (snapshot_id,))
        return SnapshotRecord.model_validate_json(rows[0][0]) if rows else None

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._write("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
        shutil.rmtree(self.files_of(snapshot_id), ignore_errors=True)

    def snapshots(
        self,
        *,
        owner: str | None = None,
        kind: SnapshotKind | None = None,
        session_id: str | None = None,
    ) -> list[SnapshotRecord]:
        where, args = _filters(owner=owner, kind=kind, session_id=session_id)
        sql = "SELECT doc FROM snapshots" + _where(where) + " ORDER BY created_at DESC"
        return [SnapshotRecord.model_validate_json(r[0]) for r in self._rows(sql, tuple(args))]

    def usage(self, owner: str) -> tuple[int, int]:
        rows = self._rows(
            "SELECT count(CASE WHEN kind = 'snapshot' THEN 1 END), coalesce(sum(bytes), 0) "
            "FROM snapshots WHERE owner = ?",
            (owner,),
        )
        return int(rows[0][0]), int(rows[0][1])

    def orphan_files(self) -> list[Path]:
        """Saved states' directories no row names (a crash between writing and recording)."""
        known = {r[0] for r in self._rows("SELECT id FROM snapshots")}
        return [p for p in self._files.iterdir() if p.name not in known]


def _filters(**columns: object) -> tuple[list[str], list[object]]:
    where = [f"{name} = ?" for name, value in columns.items() if value is not None]
    args = [value for value in columns.values() if value is not None]
    return where, args


def _where(clauses: list[str]) -> str:
    return " WHERE " + " AND ".join(clauses) if clauses else ""
