"""Session records and saved states in the SQLite file under the state dir (sqlite_db.py), and
saved states' files beside it.

Rows hold JSON documents (the records' own schema) plus the columns queries filter on, so a new
field needs no migration. Every statement runs on the database's thread.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.state_store.interfaces import StateStore, with_changes
from orchestrator.state_store.records import (
    SessionRecord,
    SessionState,
    SnapshotKind,
    SnapshotRecord,
)
from orchestrator.state_store.sqlite_db import SqliteDatabase

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


class SqliteStore(StateStore):
    def __init__(self, db: SqliteDatabase, files: Path | None = None) -> None:
        """`db`: the state dir's file; saved states' files go in `files` (by default
        `snapshots/` beside it)."""
        self.database = db
        self._files = files or db.path.parent / "snapshots"
        self._files.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._files.chmod(0o700)
        self._db = db.connection
        self._lock = db.lock
        db.executescript(_SCHEMA)

    async def ping(self) -> None:
        """A local file: nothing to reach."""

    async def close(self) -> None:
        """The database is closed by whoever opened it (other stores share it)."""

    def _rows_now(self, sql: str, args: tuple[object, ...]) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def _write_now(self, sql: str, args: tuple[object, ...]) -> int:
        with self._lock:
            return int(self._db.execute(sql, args).rowcount)

    async def _rows(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        return await self.database.run(self._rows_now, sql, args)

    async def _write(self, sql: str, args: tuple[object, ...]) -> int:
        return await self.database.run(self._write_now, sql, args)

    # --- sessions
    async def put_session(self, record: SessionRecord) -> None:
        await self.database.run(self._put_now, record)

    def _put_now(self, record: SessionRecord) -> None:
        with self._lock:  # the labels read and the record written at once
            old = self._db.execute("SELECT doc FROM sessions WHERE id = ?", (record.id,))
            row = old.fetchone()
            if row is not None:
                try:
                    labels = SessionRecord.model_validate_json(row[0]).labels
                except ValidationError:  # unreadable: written over, as if none were there
                    labels = record.labels
                record = record.model_copy(update={"labels": labels})
            self._db.execute(
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

    async def set_session_labels(
        self, session_id: str, changes: Mapping[str, str | None]
    ) -> dict[str, str] | None:
        return await self.database.run(self._set_labels_now, session_id, dict(changes))

    def _set_labels_now(
        self, session_id: str, changes: dict[str, str | None]
    ) -> dict[str, str] | None:
        with self._lock:  # the labels read and written at once
            row = self._db.execute("SELECT doc FROM sessions WHERE id = ?", (session_id,))
            found = row.fetchone()
            if found is None:
                return None
            record = SessionRecord.model_validate_json(found[0])
            merged = with_changes(record.labels, changes)
            doc = record.model_copy(update={"labels": merged}).model_dump_json()
            self._db.execute("UPDATE sessions SET doc = ? WHERE id = ?", (doc, session_id))
            return merged

    async def get_session(self, session_id: str) -> SessionRecord | None:
        rows = await self._rows("SELECT doc FROM sessions WHERE id = ?", (session_id,))
        return SessionRecord.model_validate_json(rows[0][0]) if rows else None

    async def delete_session(self, session_id: str) -> None:
        await self._write("DELETE FROM sessions WHERE id = ?", (session_id,))

    async def sessions(
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
        rows = await self._rows(sql, tuple(args))
        return [SessionRecord.model_validate_json(r[0]) for r in rows]

    async def count_sessions(self, owner: str, state: SessionState) -> int:
        rows = await self._rows(
            "SELECT count(*) FROM sessions WHERE owner = ? AND state = ?", (owner, state)
        )
        return int(rows[0][0])

    async def scan_sessions(self, cursor: int, count: int) -> tuple[int, list[SessionRecord]]:
        """The running sessions in rowid order from `cursor` (a rowid; 0: from the start)."""
        rows = await self._rows(
            "SELECT rowid, doc FROM sessions WHERE state = 'running' AND rowid > ? "
            "ORDER BY rowid LIMIT ?",
            (cursor, max(1, count)),
        )
        records = [SessionRecord.model_validate_json(doc) for _, doc in rows]
        return (int(rows[-1][0]) if len(rows) == max(1, count) else 0), records

    # --- snapshots
    def files_of(self, snapshot_id: str) -> Path:
        if not snapshot_id.replace("-", "").isalnum():  # ids are made here; never a path
            raise ValueError(f"not a snapshot id: {snapshot_id!r}")
        return self._files / snapshot_id

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        await self._write(
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

    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        rows = await self._rows("SELECT doc FROM snapshots WHERE id = ?", (snapshot_id,))
        return SnapshotRecord.model_validate_json(rows[0][0]) if rows else None

    async def delete_snapshot(self, snapshot_id: str) -> None:
        files = self.files_of(snapshot_id)
        await self._write("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
        await asyncio.to_thread(shutil.rmtree, files, True)  # files, not the store

    async def snapshots(
        self,
        *,
        owner: str | None = None,
        kind: SnapshotKind | None = None,
        session_id: str | None = None,
    ) -> list[SnapshotRecord]:
        where, args = _filters(owner=owner, kind=kind, session_id=session_id)
        sql = "SELECT doc FROM snapshots" + _where(where) + " ORDER BY created_at DESC"
        rows = await self._rows(sql, tuple(args))
        return [SnapshotRecord.model_validate_json(r[0]) for r in rows]

    async def usage(self, owner: str) -> tuple[int, int]:
        rows = await self._rows(
            "SELECT count(CASE WHEN kind = 'snapshot' THEN 1 END), coalesce(sum(bytes), 0) "
            "FROM snapshots WHERE owner = ?",
            (owner,),
        )
        return int(rows[0][0]), int(rows[0][1])

    async def orphan_files(self) -> list[Path]:
        known = {r[0] for r in await self._rows("SELECT id FROM snapshots")}
        present = await asyncio.to_thread(lambda: list(self._files.iterdir()))
        return [p for p in present if p.name not in known]


def _filters(**columns: object) -> tuple[list[str], list[object]]:
    where = [f"{name} = ?" for name, value in columns.items() if value is not None]
    args = [value for value in columns.values() if value is not None]
    return where, args


def _where(clauses: list[str]) -> str:
    return " WHERE " + " AND ".join(clauses) if clauses else ""
