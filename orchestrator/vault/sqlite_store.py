"""Sealed secrets in a SQLite file of their own (`vault.db` in the state dir, mode 0600): apart
from `state.db`, so that copying or inspecting the session records never carries them along.
One connection, one lock, statements on a thread (the loop never waits on the disk)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

from pydantic import ValidationError

from orchestrator.vault.records import SecretRecord, SecretsFull
from orchestrator.vault.store import VaultStore

FILE = "vault.db"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS secrets (
    owner TEXT NOT NULL, name TEXT NOT NULL, doc TEXT NOT NULL, PRIMARY KEY (owner, name));
"""


class SqliteVault(VaultStore):
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / FILE
        self.path.touch(mode=0o600, exist_ok=True)
        self.path.chmod(0o600)
        self._db = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=5.0
        )
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA secure_delete=ON")  # a deleted value is overwritten
            self._db.executescript(_SCHEMA)

    async def put(self, record: SecretRecord, max_per_owner: int) -> bool:
        return await asyncio.to_thread(self._put, record, max_per_owner)

    def _put(self, record: SecretRecord, max_per_owner: int) -> bool:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT doc FROM secrets WHERE owner = ? AND name = ?",
                    (record.owner, record.name),
                ).fetchone()
                if row is not None:
                    try:  # one gone bad at rest is replaced, keeping the new time
                        earlier = SecretRecord.model_validate_json(row[0])
                        record = record.model_copy(update={"created_at": earlier.created_at})
                    except ValidationError:
                        pass
                else:
                    (held,) = self._db.execute(
                        "SELECT COUNT(*) FROM secrets WHERE owner = ?", (record.owner,)
                    ).fetchone()
                    if held >= max_per_owner:
                        raise SecretsFull(
                            f"this key holds {held} secrets, the most it may: delete one first"
                        )
                self._db.execute(
                    "INSERT OR REPLACE INTO secrets VALUES (?, ?, ?)",
                    (record.owner, record.name, record.model_dump_json()),
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return row is not None

    async def get(self, owner: str, name: str) -> SecretRecord | None:
        row = await asyncio.to_thread(
            self._fetch, "SELECT doc FROM secrets WHERE owner = ? AND name = ?", (owner, name)
        )
        return SecretRecord.model_validate_json(row[0][0]) if row else None

    async def owned(self, owner: str) -> list[SecretRecord]:
        rows = await asyncio.to_thread(
            self._fetch, "SELECT doc FROM secrets WHERE owner = ? ORDER BY name", (owner,)
        )
        return [SecretRecord.model_validate_json(r[0]) for r in rows]

    def _fetch(self, sql: str, args: tuple[str, ...]) -> list[tuple[str]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    async def delete(self, owner: str, name: str) -> bool:
        return await asyncio.to_thread(self._delete, owner, name)

    def _delete(self, owner: str, name: str) -> bool:
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM secrets WHERE owner = ? AND name = ?", (owner, name)
            )
            return cursor.rowcount > 0

    async def close(self) -> None:
        with self._lock:
            self._db.close()
