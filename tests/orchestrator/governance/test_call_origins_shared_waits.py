"""A wait for a human's approval of a call whose origin another replica runs (cluster mode) is
bounded as a local one is: it ends before that origin's time limit, it is abandoned when that
origin ends, and an approval that comes as it ends runs nothing. Two replicas (each its own
`Approvals`, its own store handle) on one real Redis on 127.0.0.1; the call is taken by the one
that does not run its origin."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from code_interpreter_wire.approval_outcome import ABANDONED, TIMEOUT
from orchestrator.config import Settings
from orchestrator.governance.approvals import Approvals
from orchestrator.governance.policy import FULL_ACCESS, Principal
from orchestrator.governance.stores.approval_store import ApprovalRecord
from orchestrator.governance.tool_guard import SessionToolGuard
from orchestrator.host_tools import function_tool
from tests.orchestrator.governance.approval_tools import send_money
from tests.orchestrator.governance.store_handles import StoreHandle, replica_approvals, shared_store

ALICE = Principal(id="p_alice", name="alice", admin=True, policy=FULL_ACCESS)
SEND_MONEY = function_tool(send_money, requires_approval=True)
SESSION = "s-1"


@dataclass
class Replicas:
    here: Approvals  # runs the origin
    there: Approvals  # takes its call
    here_store: StoreHandle
    guard: SessionToolGuard  # the session's calls, as `there` guards them


@pytest.fixture
async def replicas(redis_url: str, tmp_path: Path) -> AsyncIterator[Replicas]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    one = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    other = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    settings = Settings(api_keys=["k"], state_dir=tmp_path / "state", approval_timeout_s=30)

    here, there = replica_approvals(one, settings, ALICE), replica_approvals(other, settings, ALICE)
    guard = SessionToolGuard(
        there, session_id=SESSION, owner=ALICE.id, policy_of=lambda: FULL_ACCESS
    )
    try:
        yield Replicas(here, there, one, guard)
    finally:
        await here.close()
        await there.close()
        await one.close()
        await other.close()


async def published(store: StoreHandle) -> ApprovalRecord:
    deadline = time.monotonic() + 30
    while not (found := await store.approvals.approvals(state="pending")):
        assert time.monotonic() < deadline, "no request was published"
        await asyncio.sleep(0.02)
    [pending] = found
    return pending


async def test_the_wait_ends_before_the_time_limit_of_the_origin_another_replica_runs(
    replicas: Replicas,
) -> None:
    entry = await replicas.here.origins.open(SESSION, "execution", "pay()", 3, shared=True)
    started = time.monotonic()
    outcome = await asyncio.wait_for(
        replicas.guard.approve(SEND_MONEY, {"to": "eve", "amount": 9}, entry.origin), 20
    )
    assert outcome.decision == "denied" and outcome.decided_by == TIMEOUT, outcome
    assert "the time its execution had left" in (outcome.reason or ""), outcome
    assert time.monotonic() - started < 3, outcome  # not approval_timeout_s (30 s)


async def test_the_wait_is_abandoned_when_the_origin_ends_on_the_other_replica(
    replicas: Replicas,
) -> None:
    entry = await replicas.here.origins.open(SESSION, "execution", "pay()", 60, shared=True)
    wait = asyncio.ensure_future(
        replicas.guard.approve(SEND_MONEY, {"to": "eve", "amount": 9}, entry.origin)
    )
    pending = await published(replicas.here_store)
    assert pending.code == "pay()", pending
    replicas.here.origins.end(entry)  # the execution ended on the replica that runs it
    outcome = await asyncio.wait_for(wait, 10)  # not approval_timeout_s (30 s)
    assert outcome.decision == "denied" and outcome.decided_by == ABANDONED, outcome
    found = await replicas.here_store.approvals.get_approval(pending.id)
    assert found is not None and found.state == "expired", found


async def test_an_approval_that_comes_as_the_origin_ends_elsewhere_runs_nothing(
    replicas: Replicas,
) -> None:
    """The answer comes (from the session's MCP client) just after the origin ended on the
    other replica: the call is not run, whichever the waiter saw first."""
    entry = await replicas.here.origins.open(SESSION, "execution", "pay()", 60, shared=True)

    async def answer_once_it_ended(record: ApprovalRecord) -> tuple[bool, str | None]:
        replicas.here.origins.end(entry)
        deadline = time.monotonic() + 10
        while await replicas.here_store.origins.get_origin(SESSION, entry.origin):
            assert time.monotonic() < deadline, "the origin was never deleted"
            await asyncio.sleep(0.01)
        return True, "fine"

    with replicas.there.responder(SESSION, answer_once_it_ended):
        outcome = await asyncio.wait_for(
            replicas.guard.approve(SEND_MONEY, {"to": "eve", "amount": 9}, entry.origin), 20
        )
    assert not outcome.approved and outcome.decided_by == ABANDONED, outcome
    assert "has ended" in (outcome.reason or ""), outcome
