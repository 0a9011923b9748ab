"""Keys as principals in the service's SQLite file (`state.db`), beside the session records.

A row per principal (its JSON document plus the columns looked up by) and a row per key digest
naming its principal, so a key is found by its digest in one indexed read. Never a key itself.

It shares the parent store's connection and lock; `code-interpreter keys ...` opens the same
file from another process while the service runs (WAL and the connection's busy timeout let
them take turns), and the service reads the changes within a second (`Principals`).
"""

from __future__ import annotations

import sqlite3

from orchestrator.governance.stores.principal_store import (
    PrincipalNameTaken,
    PrincipalRecord,
    PrincipalStore,
)
from orchestrator.state_store.sqlite_db import SqliteDatabase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS principals (
    id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, revoked_at REAL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS principal_keys (
    digest TEXT PRIMARY KEY, principal_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS principal_keys_by_principal ON principal_keys (principal_id);
"""


class SqlitePrincipals(PrincipalStore):
    def __init__(self, db: SqliteDatabase) -> None:
        """`db`: the service's SQLite file (its statements run on its thread)."""
        self._db = db.connection
        self._lock = db.lock
        self._run = db.run
        db.executescript(_SCHEMA)

    async def put_principal(self, record: PrincipalRecord) -> None:
        await self._run(self._put, record)

    def _put(self, record: PrincipalRecord) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # An upsert by id, never INSERT OR REPLACE: that would delete another
                # principal holding the same name instead of refusing.
                self._db.execute(
                    "INSERT INTO principals VALUES (?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                    "name = excluded.name, revoked_at = excluded.revoked_at, doc = excluded.doc",
                    (record.id, record.name, record.revoked_at, record.model_dump_json()),
                )
                self._db.execute("DELETE FROM principal_keys WHERE principal_id = ?", (record.id,))
                self._db.executemany(
                    "INSERT INTO principal_keys VALUES (?, ?)",
                    [(k.digest, record.id) for k in record.keys],
                )
            except sqlite3.IntegrityError as exc:
                self._db.execute("ROLLBACK")
                if "principals.name" in str(exc):
                    raise PrincipalNameTaken(f"a key named {record.name!r} exists") from None
                raise
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    async def _one(self, sql: str, arg: str) -> PrincipalRecord | None:
        row = await self._run(self._fetch_one, sql, arg)
        return PrincipalRecord.model_validate_json(row[0]) if row else None

    def _fetch_one(self, sql: str, arg: str) -> tuple[str] | None:
        with self._lock:
            row: tuple[str] | None = self._db.execute(sql, (arg,)).fetchone()
        return row

    async def get_principal(self, name: str) -> PrincipalRecord | None:
        return await self._one("SELECT doc FROM principals WHERE name = ?", name)

    async def principal_by_id(self, principal_id: str) -> PrincipalRecord | None:
        return await self._one("SELECT doc FROM principals WHERE id = ?", principal_id)

    async def principal_by_digest(self, digest: str) -> PrincipalRecord | None:
        return await self._one(
            "SELECT p.doc FROM principal_keys k JOIN principals p ON p.id = k.principal_id "
            "WHERE k.digest = ?",
            digest,
        )

    async def principals(self) -> list[PrincipalRecord]:
        rows = await self._run(self._all)
        return [PrincipalRecord.model_validate_json(r[0]) for r in rows]

    def _all(self) -> list[tuple[str]]:
        with self._lock:
            return list(self._db.execute("SELECT doc FROM principals ORDER BY name").fetchall())
