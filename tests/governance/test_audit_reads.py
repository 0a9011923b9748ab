"""Reading the audit log never holds up the service's other store calls: a query (however long
it scans) runs on a connection of its own, not under the lock the session records' calls take.
Retention by count keeps the newest events without walking the table. A cursor no event can
have is a 422, not a 500."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from orchestrator.state_store.audit_store import AuditEvent, AuditQuery
from orchestrator.state_store.sqlite_store import SqliteStore
from tests.service.conftest import Server


def events(count: int, kind: str = "execution") -> list[AuditEvent]:
    now = time.time()
    return [
        AuditEvent(id=os.urandom(12).hex(), time=now + i, kind=kind, owner="p_1", principal="a")
        for i in range(count)
    ]


def test_a_query_does_not_wait_for_the_stores_lock(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    try:
        store.audit.append_events(events(10))
        answered: list[int] = []
        with store._lock:  # another store call holds the connection (e.g. a long write)
            reader = threading.Thread(
                target=lambda: answered.append(len(store.audit.query_events(AuditQuery())))
            )
            reader.start()
            reader.join(timeout=5)
            assert answered == [10], "the audit query waited for the session store's lock"
    finally:
        store.close()


def test_retention_by_count_keeps_exactly_the_newest(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path)
    try:
        store.audit.append_events(events(30))
        newest = [e.seq for e in store.audit.query_events(AuditQuery(limit=12))]
        assert store.audit.keep_newest(12) == 18
        assert [e.seq for e in store.audit.query_events(AuditQuery(limit=100))] == newest
        assert store.audit.keep_newest(12) == 0
        assert store.audit.keep_newest(100) == 0
    finally:
        store.close()


def test_a_cursor_past_any_seq_is_refused_as_bad_input(governed_server: Server) -> None:
    with governed_server.client() as api:
        for path in ("/v1/audit", "/v1/audit/export"):
            answered = api.get(path, params={"before": str(1 << 70)})
            assert answered.status_code == 422, answered.text
        long_id = api.get("/v1/approvals/" + "a" * 5000)
        assert long_id.status_code == 422, long_id.text
