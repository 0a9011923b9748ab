"""Approval requests where they are kept and waited on: both stores (SQLite under the state dir,
a real redis-server on 127.0.0.1) decide each request once across two handles (two processes, two
replicas); `Approvals` over a real SQLite store is answered from another handle, caps what it
keeps and what waits, marks an abandoned wait, and a hung webhook delays no decision."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from code_interpreter_wire.approval_outcome import ABANDONED
from orchestrator.config import Settings
from orchestrator.governance.approval_errors import ApprovalsFull
from orchestrator.governance.approvals import (
    MAX_ARGUMENTS_CHARS,
    MAX_CODE_CHARS,
    MAX_SUBJECT_CHARS,
    SESSION_ENDED,
    Approvals,
)
from orchestrator.governance.policy import FULL_ACCESS, Principal
from orchestrator.governance.stores.approval_store import ApprovalRecord, ApprovalStore
from orchestrator.host_tools import (
    ChannelLimits,
    HostToolsSettings,
    HttpToolConfig,
    McpServerConfig,
    ToolChannel,
    ToolRegistry,
)
from orchestrator.settings_sections import ApprovalSection
from tests.orchestrator.governance.approval_tools import add, send_money
from tests.orchestrator.governance.store_handles import (
    StoreHandle,
    local_store,
    replica_approvals,
    shared_store,
)

MCP_SERVER = str(Path(__file__).parents[1] / "host_tools" / "example_mcp_tool_server.py")
ALICE = Principal(id="p_alice", name="alice", admin=True, policy=FULL_ACCESS)


def record(approval_id: str, owner: str = "p_a", session_id: str = "s-1", **fields: Any) -> Any:
    now = time.time()
    values: dict[str, Any] = {
        "id": approval_id,
        "kind": "tool_call",
        "session_id": session_id,
        "owner": owner,
        "principal": owner,
        "subject": "send_money",
        "arguments": {"to": "bob"},
        "created_at": now,
        "expires_at": now + 60,
        **fields,
    }
    return ApprovalRecord.model_validate(values)


@pytest.fixture
def two_handles(
    store_pair: tuple[StoreHandle, StoreHandle],
) -> tuple[ApprovalStore, ApprovalStore]:
    """Two handles on one store, as two processes (SQLite) or two replicas (Redis) hold."""
    return store_pair[0].approvals, store_pair[1].approvals


async def test_a_request_is_decided_once_whichever_handle_answers(
    two_handles: tuple[ApprovalStore, ApprovalStore],
) -> None:
    a, b = two_handles
    await a.put_approval(record("ap-1"))
    await a.put_approval(record("ap-2", owner="p_b", session_id="s-2"))
    assert await b.get_approval("ap-1") == await a.get_approval("ap-1")
    assert await b.get_approval("ap-nope") is None

    won = await b.decide_approval("ap-1", "approved", "alice", "fine", time.time())
    assert won is not None and won.state == "approved" and won.decided_by == "alice"
    assert await a.decide_approval("ap-1", "denied", "bob", None, time.time()) is None  # one wins
    assert await a.decide_approval("ap-nope", "denied", "bob", None, time.time()) is None
    seen = await a.get_approval("ap-1")
    assert seen is not None and seen.state == "approved" and seen.reason == "fine"

    assert [r.id for r in await a.approvals(state="pending")] == ["ap-2"]
    assert [r.id for r in await b.approvals(owner="p_a")] == ["ap-1"]
    assert [r.id for r in await b.approvals(session_id="s-2")] == ["ap-2"]
    assert [r.id for r in await a.approvals()] == ["ap-2", "ap-1"]  # newest first
    assert len(await a.approvals(limit=1)) == 1


async def test_concurrent_answers_have_one_winner(
    two_handles: tuple[ApprovalStore, ApprovalStore],
) -> None:
    a, b = two_handles
    await a.put_approval(record("ap-race"))
    results: list[object] = []

    async def answer(store: ApprovalStore, who: str) -> None:
        results.append(await store.decide_approval("ap-race", "approved", who, None, time.time()))

    await asyncio.gather(*(answer(s, f"p{i}") for i, s in enumerate([a, b] * 4)))
    assert sum(r is not None for r in results) == 1


def settings(tmp_path: Path, **values: Any) -> Settings:
    return Settings(api_keys=["k"], state_dir=tmp_path / "state", **values)


async def wait_for_pending(store: ApprovalStore, count: int = 1) -> list[ApprovalRecord]:
    deadline = time.monotonic() + 30
    while len(found := await store.approvals(state="pending")) < count:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    return found


async def test_an_answer_through_another_handle_reaches_the_waiter(tmp_path: Path) -> None:
    """As another replica (or the CLI's process) would answer: the waiter reads it from the
    store, within its poll."""
    waiting_side, answering_side = local_store(tmp_path / "state"), local_store(tmp_path / "state")
    s = settings(tmp_path, approval_timeout_s=30)
    waiter = Approvals(
        ApprovalSection.of(s), lambda: waiting_side.approvals, principal_of=lambda _: ALICE
    )
    answerer = Approvals(
        ApprovalSection.of(s), lambda: answering_side.approvals, principal_of=lambda _: ALICE
    )
    try:
        wait = asyncio.ensure_future(
            waiter.request("tool_call", session_id="s-1", owner="p_alice", subject="send_money")
        )
        [pending] = await wait_for_pending(answering_side.approvals)
        await answerer.answer(pending.id, False, "from the other side", ALICE)
        outcome = await asyncio.wait_for(wait, 10)
        assert outcome.decision == "denied" and outcome.reason == "from the other side"
        assert outcome.decided_by == "alice" and outcome.waited_s < 10
    finally:
        await waiting_side.close()
        await answering_side.close()


async def test_a_session_ended_on_another_replica_ends_its_waits_here(
    redis_url: str, tmp_path: Path
) -> None:
    """Cluster mode (any replica ends any session): a session ended on another replica ends the
    waits this one holds for it, within a poll, not at their time limit; another session's wait
    goes on. Two replicas' handles on one real Redis."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    waiting_side = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    ending_side = shared_store(redis_url, prefix=prefix, snapshots_dir=tmp_path / "snaps")
    s = settings(tmp_path, approval_timeout_s=60)

    waiter = replica_approvals(waiting_side, s, ALICE)
    ender = replica_approvals(ending_side, s, ALICE)

    def request(session_id: str) -> asyncio.Future[Any]:
        return asyncio.ensure_future(
            waiter.request("tool_call", session_id=session_id, owner="p_alice", subject="add")
        )

    ended, other = request("s-ended"), request("s-other")
    try:
        await wait_for_pending(ending_side.approvals, 2)
        ender.abandon_session("s-ended")  # nothing of it waits there: the store's are ended
        await ender.abandon_session_elsewhere("s-ended")
        outcome = await asyncio.wait_for(ended, 10)
        assert (outcome.decision, outcome.decided_by) == ("denied", ABANDONED)
        assert outcome.reason == SESSION_ENDED and outcome.waited_s < 10
        assert not other.done()
        [still] = await ending_side.approvals.approvals(state="pending")
        assert still.session_id == "s-other"
    finally:
        other.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await other
        for approvals in (waiter, ender):
            await approvals.close()
        for store in (waiting_side, ending_side):
            await store.close()


async def test_what_waits_and_what_is_kept_are_capped(tmp_path: Path) -> None:
    store = local_store(tmp_path / "state")
    s = settings(tmp_path, approval_max_pending_total=1, approval_timeout_s=30)
    approvals = Approvals(
        ApprovalSection.of(s), lambda: store.approvals, principal_of=lambda _: ALICE
    )
    try:
        huge_code = "x = 1\n" * 50_000
        huge_arguments = {"memo": "m" * (MAX_ARGUMENTS_CHARS * 4)}
        first = asyncio.ensure_future(
            approvals.request(
                "tool_call",
                session_id="s-1",
                owner="p_alice",
                subject="s" * (MAX_SUBJECT_CHARS * 3),
                arguments=huge_arguments,
                code=huge_code,
            )
        )
        [kept] = await wait_for_pending(store.approvals)
        assert len(kept.code or "") < MAX_CODE_CHARS + 100 and "more characters]" in (
            kept.code or ""
        )
        assert len(kept.subject) < MAX_SUBJECT_CHARS + 100
        assert kept.arguments["truncated"] is True
        assert len(kept.arguments["preview"]) == MAX_ARGUMENTS_CHARS
        assert kept.arguments["bytes"] > MAX_ARGUMENTS_CHARS * 4
        with pytest.raises(ApprovalsFull, match="wait on this service already"):
            await approvals.request("execution", session_id="s-2", owner="p_alice", subject="x")
        assert approvals.waiting == 1

        # The caller leaves (its session ended): the request is marked, not left pending.
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        gone = await store.approvals.get_approval(kept.id)
        assert gone is not None and gone.state == "expired" and gone.decided_by == "abandoned"
        assert approvals.waiting == 0
    finally:
        await store.close()


@pytest.fixture
def hung_webhook() -> Iterator[str]:
    """A webhook that never answers in time."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None: ...

        def do_POST(self) -> None:
            release.wait(30)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    release.set()
    server.shutdown()


async def test_a_hung_webhook_holds_up_nothing(tmp_path: Path, hung_webhook: str) -> None:
    store = local_store(tmp_path / "state")
    s = settings(
        tmp_path,
        approval_timeout_s=2,
        approval_webhook_url=hung_webhook,
        approval_webhook_timeout_s=0.3,
    )
    approvals = Approvals(
        ApprovalSection.of(s), lambda: store.approvals, principal_of=lambda _: ALICE
    )
    try:
        started = time.monotonic()
        outcome = await approvals.request(
            "command", session_id="s-1", owner="p_alice", subject="rm -rf /tmp/x"
        )
        assert outcome.decision == "denied" and outcome.decided_by == "timeout"
        assert outcome.reason == "no one answered within 2 s"
        assert 2 <= time.monotonic() - started < 6
        await approvals.close()
    finally:
        await store.close()


async def test_every_source_of_tools_can_require_approval() -> None:
    """Python callables by a registration parameter, HTTP tools and MCP servers by their
    settings (an MCP server's named tools, or all of them); the manifest's time limit of such a
    tool includes the wait, and a channel with no one to ask never runs one."""
    registry = ToolRegistry()
    registry.add_function(send_money, requires_approval=True)
    registry.add_function(add)
    registry.configure(
        HostToolsSettings(
            http=[
                HttpToolConfig(name="post_it", url="http://127.0.0.1:9/x", requires_approval=True)
            ],
            mcp=[
                McpServerConfig(
                    command=sys.executable,
                    args=[MCP_SERVER],
                    prefix="m_",
                    requires_approval=["shout"],
                ),
                McpServerConfig(
                    command=sys.executable, args=[MCP_SERVER], prefix="all_", requires_approval=True
                ),
            ],
        )
    )
    await registry.start()
    try:
        waits = {name for name in registry.names if registry.get(name).requires_approval}
        assert waits == {
            "send_money", "post_it", "m_shout",
            "all_add", "all_word_count", "all_shout", "all_fail",
        }  # fmt: skip
        limits = ChannelLimits(call_timeout_s=7, approval_timeout_s=100)
        channel = ToolChannel.relayed(registry.select(["send_money", "add"]), limits)
        manifest = {t["name"]: t for t in json.loads(channel.manifest())["tools"]}
        assert manifest["send_money"]["timeout_s"] == 107
        assert manifest["send_money"]["requires_approval"] is True
        assert manifest["add"]["timeout_s"] == 7 and manifest["add"]["requires_approval"] is False
        call = json.dumps({"id": 1, "tool": "send_money", "arguments": {"to": "x", "amount": 1}})
        reply = json.loads(await channel.answer(call.encode()))
        assert reply["error"]["type"] == "denied", reply  # no guard: no one to ask, never run
        assert "needs a human's approval" in reply["error"]["message"]
    finally:
        await registry.close()
