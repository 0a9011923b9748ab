"""The audit log in the service's SQLite file (`state.db`), beside the session records.

One row per event: its JSON document plus the columns queries filter on. `seq` is an
AUTOINCREMENT key, so it only grows (a cursor stays valid after retention deletes rows), and it
is the order events were appended in. Event ids are unique: a batch written again after a
failure whose outcome was unknown is not written twice.

It writes through the parent store's connection and lock (appends are short; retention
deletes a chunk at a time). It reads through a connection of its own: a query that scans much
of a long log (a time filter, a rare kind) must not hold the lock every session record's call
takes, some of them on the event loop; WAL lets reads and writes go on together. The CLI opens
the same file from another process while the service runs (WAL, and the connections' busy
timeout, let them take turns).
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

from orchestrator.state_store.audit_store import AuditEvent, AuditPage, AuditQuery, AuditStore

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
_BUSY_TIMEOUT_S = 5.0


class SqliteAudit(AuditStore):
    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        """`db`: the parent store's connection (autocommit), `lock`: the lock guarding it."""
        self._db = db
        self._lock = lock
        with self._lock:
            self._db.executescript(_SCHEMA)
            path = next(row[2] for row in db.execute("PRAGMA database_list") if row[1] == "main")
        if path:  # a file: read it through a connection (and a lock) of the log's own
            self._reader = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=_BUSY_TIMEOUT_S
            )
            self._reader.execute("PRAGMA query_only = ON")
            self._read_lock = threading.Lock()
        else:  # in memory: no other connection sees it
            self._reader, self._read_lock = db, lock

    def close(self) -> None:
        """Close the reading connection (the parent store closes its own)."""
        if self._reader is not self._db:
            with self._read_lock:
                self._reader.close()

    def append_events(self, events: list[AuditEvent]) -> None:
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

    def query_events(self, query: AuditQuery) -> list[AuditEvent]:
        return self.query_page(query).events

    def query_page(self, query: AuditQuery) -> AuditPage:
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
        rows = self._read(sql, tuple(args))
        events = [
            AuditEvent.model_validate_json(doc).model_copy(update={"seq": seq})
            for seq, doc in rows[: query.limit]
        ]
        more = len(rows) > query.limit
        return AuditPage(events=events, next_before=events[-1].seq if more and events else None)

    def delete_events_before(self, t: float) -> int:
        return self._delete_chunks(
            "DELETE FROM audit_events WHERE seq IN "
            "(SELECT seq FROM audit_events WHERE time < ? ORDER BY seq LIMIT ?)",
            (t,),
        )

    def keep_newest(self, most: int) -> int:
        """Seqs only grow and are never reused, so the newest `most` events are those above
        the newest seq less `most`: one indexed read, not a walk past `most` rows."""
        newest = self._read("SELECT max(seq) FROM audit_events", ())[0][0]
        if newest is None or newest <= most:
            return 0
        return self._delete_chunks(
            "DELETE FROM audit_events WHERE seq IN "
            "(SELECT seq FROM audit_events WHERE seq <= ? ORDER BY seq LIMIT ?)",
            (newest - most,),
        )

    def _read(self, sql: str, args: tuple[object, ...]) -> list[tuple[Any, ...]]:
        with self._read_lock:
            return list(self._reader.execute(sql, args).fetchall())

    def _delete_chunks(self, sql: str, args: tuple[object, ...]) -> int:
        """Delete a chunk at a time, letting go of the connection between chunks: a year of
        events going at once never holds the session records' calls up for long."""
        gone = 0
        while True:
            with self._lock:
                n = self._db.execute(sql, (*args, _DELETE_CHUNK)).rowcount
            gone += n
            if n < _DELETE_CHUNK:
                return gone
