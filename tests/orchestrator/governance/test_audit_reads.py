"""Reading the audit log never holds up the service's other store calls: a query (however long
it scans) runs on a connection of its own, not under the lock the session records' calls take.
Retention by count keeps the newest events without walking the table. A cursor no event can
have is a 422, not a 500."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from orchestrator.governance.stores.audit_store import AuditEvent, AuditQuery
from tests.orchestrator.governance.store_handles import local_store
from tests.orchestrator.service.conftest import Server


def events(count: int, kind: str = "execution") -> list[AuditEvent]:
    now = time.time()
    return [
        AuditEvent(id=os.urandom(12).hex(), time=now + i, kind=kind, owner="p_1", principal="a")
        for i in range(count)
    ]


async def test_a_query_does_not_wait_for_the_stores_lock(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    try:
        await store.audit.append_events(events(10))
        with store.lock:  # another store call holds the connection (e.g. a long write)
            answered = await asyncio.wait_for(store.audit.query_events(AuditQuery()), 5)
            assert len(answered) == 10, "the audit query waited for the session store's lock"
    finally:
        await store.close()


async def test_retention_by_count_keeps_exactly_the_newest(tmp_path: Path) -> None:
    store = local_store(tmp_path)
    try:
        await store.audit.append_events(events(30))
        newest = [e.seq for e in await store.audit.query_events(AuditQuery(limit=12))]
        assert await store.audit.keep_newest(12) == 18
        assert [e.seq for e in await store.audit.query_events(AuditQuery(limit=100))] == newest
        assert await store.audit.keep_newest(12) == 0
        assert await store.audit.keep_newest(100) == 0
    finally:
        await store.close()


def test_a_cursor_past_any_seq_is_refused_as_bad_input(governed_server: Server) -> None:
    with governed_server.client() as api:
        for path in ("/v1/audit", "/v1/audit/export"):
            answered = api.get(path, params={"before": str(1 << 70)})
            assert answered.status_code == 422, answered.text
        long_id = api.get("/v1/approvals/" + "a" * 5000)
        assert long_id.status_code == 422, long_id.text
