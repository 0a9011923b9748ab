"""Approval requests in the service's SQLite file (`state.db`), beside the sessions.

Rows hold the record's JSON plus the columns listings filter on. A decision is one conditional
UPDATE (`WHERE state = 'pending'`): of two answers, from two processes even, one wins. Decided
requests are kept `retention_s`, and at most the newest `max_kept` of them (a sandbox calling a
tool a webhook decides at once makes requests as fast as it loops), removed as new ones come
in: the table stays bounded by neither the service's age nor the rate of requests.
"""

from __future__ import annotations

import time
from typing import Any

from orchestrator.governance.stores.approval_store import (
    ApprovalRecord,
    ApprovalState,
    ApprovalStore,
)
from orchestrator.state_store.sqlite_db import SqliteDatabase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS approvals (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, session_id TEXT NOT NULL, state TEXT NOT NULL,
    created_at REAL NOT NULL, decided_at REAL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS approvals_by_owner ON approvals (owner, created_at);
CREATE INDEX IF NOT EXISTS approvals_by_state ON approvals (state, created_at);
CREATE INDEX IF NOT EXISTS approvals_by_age ON approvals (coalesce(decided_at, created_at));
CREATE INDEX IF NOT EXISTS approvals_by_creation ON approvals (created_at);
"""

DEFAULT_RETENTION_S = 30 * 86400.0
DEFAULT_MAX_KEPT = 100_000  # decided requests kept at most (the newest)
_SWEEP_EVERY_S = 60.0  # decided rows past retention go at most this often (on a write)


class SqliteApprovals(ApprovalStore):
    def __init__(
        self,
        db: SqliteDatabase,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_kept: int = DEFAULT_MAX_KEPT,
    ) -> None:
        """`db`: the service's SQLite file (its statements run on its thread)."""
        self._db = db.connection
        self._lock = db.lock
        self._run = db.run
        self.retention_s = retention_s
        self.max_kept = max_kept
        self._swept_at = 0.0
        db.executescript(_SCHEMA)

    def _rows(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    async def put_approval(self, record: ApprovalRecord) -> None:
        await self._run(self._put, record)

    def _put(self, record: ApprovalRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO approvals VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.owner,
                    record.session_id,
                    record.state,
                    record.created_at,
                    record.decided_at,
                    record.model_dump_json(),
                ),
            )
        self._sweep()

    async def get_approval(self, approval_id: str) -> ApprovalRecord | None:
        rows = await self._run(self._rows, "SELECT doc FROM approvals WHERE id = ?", (approval_id,))
        return ApprovalRecord.model_validate_json(rows[0][0]) if rows else None

    async def approvals(
        self,
        *,
        owner: str | None = None,
        state: ApprovalState | None = None,
        session_id: str | None = None,
        limit: int = 100,
    ) -> list[ApprovalRecord]:
        where: list[str] = []
        args: list[object] = []
        for column, value in (("owner", owner), ("state", state), ("session_id", session_id)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        sql = "SELECT doc FROM approvals"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC LIMIT ?"
        args.append(max(0, limit))
        rows = await self._run(self._rows, sql, tuple(args))
        return [ApprovalRecord.model_validate_json(r[0]) for r in rows]

    async def decide_approval(
        self, approval_id: str, state: ApprovalState, by: str, reason: str | None, at: float
    ) -> ApprovalRecord | None:
        return await self._run(self._decide, approval_id, state, by, reason, at)

    def _decide(
        self, approval_id: str, state: ApprovalState, by: str, reason: str | None, at: float
    ) -> ApprovalRecord | None:
        with self._lock:
            rows = self._db.execute(
                "SELECT doc FROM approvals WHERE id = ? AND state = 'pending'", (approval_id,)
            ).fetchall()
            if not rows:
                return None
            record = ApprovalRecord.model_validate_json(rows[0][0]).model_copy(
                update={"state": state, "decided_by": by, "reason": reason, "decided_at": at}
            )
            # Conditional: another process may have answered since the read above.
            changed = self._db.execute(
                "UPDATE approvals SET state = ?, decided_at = ?, doc = ? "
                "WHERE id = ? AND state = 'pending'",
                (state, at, record.model_dump_json(), approval_id),
            ).rowcount
        return record if changed == 1 else None

    def _sweep(self) -> None:
        """Remove requests decided past retention, any a crash left pending as long, and the
        decided ones older than the newest `max_kept` (at most once a minute)."""
        now = time.time()
        if now - self._swept_at < _SWEEP_EVERY_S:
            return
        self._swept_at = now
        with self._lock:
            self._db.execute(
                "DELETE FROM approvals WHERE coalesce(decided_at, created_at) < ?",
                (now - self.retention_s,),
            )
            self._db.execute(  # no such row (fewer kept): NULL, and nothing goes
                "DELETE FROM approvals WHERE state != 'pending' AND created_at < "
                "(SELECT created_at FROM approvals ORDER BY created_at DESC LIMIT 1 OFFSET ?)",
                (max(0, self.max_kept - 1),),
            )
