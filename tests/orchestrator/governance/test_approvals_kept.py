"""Decided approval requests are kept within a count, not only an age: a sandbox looping over a
tool that a webhook decides at once makes requests as fast as it loops, each holding the code
that made it. The oldest decided ones go past `max_kept`; pending ones stay. Both stores: SQLite,
and Redis (a real redis-server on 127.0.0.1)."""

from __future__ import annotations

import time

import pytest

from orchestrator.governance.stores.approval_store import ApprovalRecord, ApprovalStore
from orchestrator.governance.stores.redis_approvals import RedisApprovals
from orchestrator.governance.stores.sqlite_approvals import SqliteApprovals
from tests.orchestrator.governance.store_handles import StoreHandle


@pytest.fixture
def approvals(
    store_pair: tuple[StoreHandle, StoreHandle],
) -> ApprovalStore:
    return store_pair[0].approvals


def made(index: int, state: str) -> ApprovalRecord:
    at = time.time() - 1000 + index  # in order, one a second
    return ApprovalRecord(
        id=f"ap-{index:04d}",
        kind="tool_call",
        session_id="s-1",
        owner="p_a",
        principal="a",
        subject="send_money",
        code="x" * 1000,
        created_at=at,
        expires_at=at + 60,
        state=state,  # type: ignore[arg-type]
        decided_by=None if state == "pending" else "webhook",
        decided_at=None if state == "pending" else at,
    )


async def sweep(store: ApprovalStore) -> None:
    """What a put does about once a minute (SQLite) or a second (Redis), now."""
    if isinstance(store, SqliteApprovals):
        store._swept_at = 0.0
        await store.put_approval(made(999, "denied"))
    else:
        assert isinstance(store, RedisApprovals)
        await store.trim()


async def test_only_the_newest_decided_requests_are_kept_past_the_count(
    approvals: ApprovalStore,
) -> None:
    approvals.max_kept = 10  # type: ignore[attr-defined]
    for i in range(3):
        await approvals.put_approval(made(i, "pending"))  # the oldest: still waiting
    for i in range(3, 40):
        await approvals.put_approval(made(i, "approved"))
    await sweep(approvals)
    kept = await approvals.approvals(limit=1000)
    pending = sorted(r.id for r in kept if r.state == "pending")
    assert pending == ["ap-0000", "ap-0001", "ap-0002"]  # a waiter's request never goes
    decided = [r for r in kept if r.state != "pending"]
    assert 7 <= len(decided) <= 10, [r.id for r in decided]
    newest = sorted((r.id for r in decided), reverse=True)
    assert newest[0] in ("ap-0039", "ap-0999")
    assert await approvals.get_approval("ap-0003") is None  # an old decided one is gone
    assert [r.id for r in await approvals.approvals(owner="p_a", limit=1000)] == [
        r.id for r in kept
    ]
