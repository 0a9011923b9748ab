"""The service's SQLite file as the async stores use it (orchestrator/state_store/sqlite_db.py):
every statement runs on the database's own thread, so writers awaiting it from the event loop
queue there while the loop goes on; the test holds that thread with an event it controls."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from orchestrator.governance.stores.approval_store import ApprovalRecord
from orchestrator.governance.stores.sqlite_approvals import SqliteApprovals
from orchestrator.state_store.sqlite_db import SqliteDatabase

pytestmark = pytest.mark.unit


def _request(approval_id: str) -> ApprovalRecord:
    now = time.time()
    return ApprovalRecord(
        id=approval_id,
        kind="tool_call",
        session_id="s-1",
        owner="p_a",
        principal="alice",
        subject="send_money",
        created_at=now,
        expires_at=now + 60,
    )


async def test_writers_queue_on_the_databases_thread_while_the_loop_goes_on(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(tmp_path)
    approvals = SqliteApprovals(db)
    held, release = threading.Event(), threading.Event()

    def hold_the_thread() -> str:
        held.set()
        assert release.wait(30)
        return threading.current_thread().name

    try:
        holder = asyncio.ensure_future(db.run(hold_the_thread))
        assert await asyncio.to_thread(held.wait, 30)  # the database's thread is busy now
        writers = [
            asyncio.ensure_future(approvals.put_approval(_request(f"ap-{i}"))) for i in range(20)
        ]
        # The loop is not held by them: another task runs to its end meanwhile.
        other_ran = asyncio.Event()
        asyncio.get_running_loop().call_soon(other_ran.set)
        await asyncio.wait_for(other_ran.wait(), 5)
        assert not any(w.done() for w in writers)  # queued behind the busy thread
        release.set()
        assert (await holder).startswith("sqlite")
        await asyncio.wait_for(asyncio.gather(*writers), 30)
        listed = await approvals.approvals(limit=100)
        assert sorted(r.id for r in listed) == sorted(f"ap-{i}" for i in range(20))
    finally:
        release.set()
        db.close()


async def test_two_handles_on_one_file_each_see_the_others_writes(tmp_path: Path) -> None:
    """As the service and the CLI hold it (two connections, WAL): a decision is made once."""
    first, second = SqliteDatabase(tmp_path), SqliteDatabase(tmp_path)
    mine, theirs = SqliteApprovals(first), SqliteApprovals(second)
    try:
        await mine.put_approval(_request("ap-1"))
        decided = await asyncio.gather(
            mine.decide_approval("ap-1", "approved", "alice", None, time.time()),
            theirs.decide_approval("ap-1", "denied", "bob", None, time.time()),
        )
        assert sum(d is not None for d in decided) == 1
        found = await mine.get_approval("ap-1")
        assert found is not None and found.state in ("approved", "denied")
        assert (tmp_path / "state.db").stat().st_mode & 0o777 == 0o600
    finally:
        first.close()
        second.close()
