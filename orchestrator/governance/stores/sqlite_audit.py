"""The audit log in the service's SQLite file (`state.db`), beside the session records.

One row per event: its JSON document plus the columns queries filter on. `seq` is an
AUTOINCREMENT key, so it only grows (a cursor stays valid after retention deletes rows), and it
is the order events were appended in. Event ids are unique: a batch written again after a
failure whose outcome was unknown is not written twice.

It writes through the database's connection and thread (appends are short; retention deletes
a chunk at a time). It reads through a connection and a thread of its own: a query that scans
much of a long log (a time filter, a rare kind) must not hold up every session record's write;
WAL lets reads and writes go on together. The CLI opens
the same file from another process while the service runs (WAL, and the connections' busy
timeout, let them take turns).
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator.governance.stores.audit_store import AuditEvent, AuditPage, AuditQuery, AuditStore
from orchestrator.state_store.sqlite_db import BUSY_TIMEOUT_S, SqliteDatabase

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, time REAL NOT NULL,
    kind TEXT NOT NULL, owner TEXT NOT NULL, principal TEXT NOT NULL, session_id TEXT,
    doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_owner ON audit_events (owner, seq);
CREATE INDEX IF NOT EXISTS audit_by_principal ON audit_events (principal, seq);
CREATE INDEX IF NOT EXISTS audit_by_session ON audit_events (session_id, seq);
CREATE INDEX IF NOT EXISTS audit_by_kind ON audit_events (kind, seq);
CREATE INDEX IF NOT EXISTS audit_by_time ON audit_events (time);
"""
_DELETE_CHUNK = 5000  # rows deleted per statement by retention
MAX_SEQ = (1 << 63) - 1  # the largest INTEGER: a cursor past it means "from the newest"


class SqliteAudit(AuditStore):
    def __init__(self, db: SqliteDatabase) -> None:
        """`db`: the service's SQLite file (writes run on its thread)."""
        self._db = db.connection
        self._lock = db.lock
        self._run = db.run
        db.executescript(_SCHEMA)
        # Reads: a connection, a lock and a thread of the log's own.
        self._reader = sqlite3.connect(
            db.path, check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S
        )
        self._reader.execute("PRAGMA query_only = ON")
        self._read_lock = threading.Lock()
        self._read_thread = ThreadPoolExecutor(1, thread_name_prefix="sqlite-audit-read")

    def close(self) -> None:
        """Close the reading connection (the database closes its own)."""
        self._read_thread.shutdown(wait=True)
        with self._read_lock:
            self._reader.close()

    async def append_events(self, events: list[AuditEvent]) -> None:
        await self._run(self._append, events)

    def _append(self, events: list[AuditEvent]) -> None:
        rows = [
            (
                e.id,
                e.time,
                e.kind,
                e.owner,
                e.principal,
                e.session_id,
                e.model_dump_json(exclude={"seq"}),
            )
            for e in events
        ]
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO audit_events "
                    "(id, time, kind, owner, principal, session_id, doc) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    async def query_events(self, query: AuditQuery) -> list[AuditEvent]:
        return (await self.query_page(query)).events

    async def query_page(self, query: AuditQuery) -> AuditPage:
        where: list[str] = []
        args: list[Any] = []
        for column, value in (
            ("owner", query.owner),
            ("principal", query.principal),
            ("session_id", query.session_id),
        ):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if query.kinds:
            where.append(f"kind IN ({', '.join('?' for _ in query.kinds)})")
            args += query.kinds
        if query.since is not None:
            where.append("time >= ?")
            args.append(query.since)
        if query.until is not None:
            where.append("time < ?")
            args.append(query.until)
        if query.before_seq is not None:
            where.append("seq < ?")
            args.append(min(query.before_seq, MAX_SEQ))
        sql = "SELECT seq, doc FROM audit_events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        args.append(query.limit + 1)  # one more: whether there is a next page
        rows = await self._read(sql, tuple(args))
        events = [
            AuditEvent.model_validate_json(doc).model_copy(update={"seq": seq})
            for seq, doc in rows[: query.limit]
        ]
        more = len(rows) > query.limit
        return AuditPage(events=events, next_before=events[-1].seq if more and events else None)

    async def delete_events_before(self, t: float) -> int:
        return await self._delete_chunks(
            "DELETE FROM audit_events WHERE seq IN "
            "(SELECT seq FROM audit_events WHERE time < ? ORDER BY seq LIMIT ?)",
            (t,),
        )

    async def keep_newest(self, most: int) -> int:
        """Seqs only grow and are never reused, so the newest `most` events are those above
        the newest seq less `most`: one indexed read, not a walk past `most` rows."""
        newest = (await self._read("SELECT max(seq) FROM audit_events", ()))[0][0]
        if newest is None or newest <= most:
            return 0
        return await self._delete_chunks(
            "DELETE FROM audit_events WHERE seq IN "
            "(SELECT seq FROM audit_events WHERE seq <= ? ORDER BY seq LIMIT ?)",
            (newest - most,),
        )

    async def _read(self, sql: str, args: tuple[object, ...]) -> list[tuple[Any, ...]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._read_thread, functools.partial(self._read_now, sql, args)
        )

    def _read_now(self, sql: str, args: tuple[object, ...]) -> list[tuple[Any, ...]]:
        with self._read_lock:
            return list(self._reader.execute(sql, args).fetchall())

    def _delete_chunk(self, sql: str, args: tuple[object, ...]) -> int:
        with self._lock:
            return int(self._db.execute(sql, (*args, _DELETE_CHUNK)).rowcount)

    async def _delete_chunks(self, sql: str, args: tuple[object, ...]) -> int:
        """Delete a chunk at a time, letting go of the database's thread between chunks: a
        year of events going at once never holds the session records' calls up for long."""
        gone = 0
        while True:
            n = await self._run(self._delete_chunk, sql, args)
            gone += n
            if n < _DELETE_CHUNK:
                return gone
