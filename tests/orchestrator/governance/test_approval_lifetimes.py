"""A wait for a human never outlives what it waits for: a tool call's wait ends before its
execution's time limit (the code reads ToolDenied, it is not interrupted mid-wait); a call whose
execution was interrupted is abandoned (no later approval can run it); a session that ends
while an execution or a command waits for its gate lets the caller go at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.orchestrator.governance.conftest import ADMIN_KEY, eventually, unique_name
from tests.orchestrator.service.conftest import Server


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as running:
        yield running


def pending_of(api: httpx.Client, session_id: str, within_s: float = 30) -> dict[str, Any]:
    """The session's one pending approval request, once it is there."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = api.get("/v1/approvals", params={"state": "pending", "session_id": session_id})
        assert found.status_code == 200, found.text
        if found.json():
            [record] = found.json()
            return dict(record)
        time.sleep(0.05)
    raise AssertionError(f"no pending approval in {session_id}")


def session_with_add(api: httpx.Client) -> str:
    created = api.post("/v1/sessions", json={"backend": "local", "tools": ["add"]})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_a_tool_calls_wait_ends_before_its_executions_time_limit(
    governed_server: Server, add_key: Callable[..., str]
) -> None:
    key = add_key(unique_name("waiter"), "--approval-tools", "add")
    code = (
        "import host_tools, time\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    host_tools.sync.add(1, b=2)\n"
        "except host_tools.ToolDenied as e:\n"
        "    print('DENIED after', round(time.monotonic() - started, 1), 's:', e)\n"
    )
    with governed_server.client(key) as api:
        sid = session_with_add(api)
        try:
            ran = api.post(
                f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 6}, timeout=60
            )
            assert ran.status_code == 200, ran.text
            body = ran.json()
            # The code read the denial itself, within its time limit: it was not interrupted.
            assert body["status"] == "ok", body
            assert "DENIED after" in body["stdout"], body
            assert "no one answered within" in body["stdout"], body["stdout"]
            assert "the time its execution had left" in body["stdout"], body["stdout"]
            [record] = api.get("/v1/approvals", params={"session_id": sid}).json()
            assert record["state"] == "denied" and record["decided_by"] == "timeout"
            assert record["expires_at"] - record["created_at"] < 6
        finally:
            api.delete(f"/v1/sessions/{sid}")


def test_an_interrupted_executions_waiting_call_is_abandoned_and_never_runs(
    governed_server: Server, add_key: Callable[..., str], pool: ThreadPoolExecutor
) -> None:
    key = add_key(unique_name("interrupted"), "--approval-tools", "add")
    code = "import host_tools\nprint(host_tools.sync.add(1, b=2))"
    with governed_server.client(key) as api, governed_server.client(ADMIN_KEY) as admin:
        sid = session_with_add(api)
        try:
            running = pool.submit(
                lambda: api.post(f"/v1/sessions/{sid}/execute", json={"code": code}, timeout=120)
            )
            pending = pending_of(api, sid)
            assert api.post(f"/v1/sessions/{sid}/interrupt").json() == {"interrupted": True}
            ran = running.result(timeout=30)
            assert ran.status_code == 200 and ran.json()["status"] != "ok", ran.text

            def decided() -> dict[str, Any]:
                return dict(api.get(f"/v1/approvals/{pending['id']}").json())

            assert eventually(lambda: decided()["state"] != "pending", within_s=10), decided()
            record = decided()
            assert record["state"] == "expired" and record["decided_by"] == "abandoned", record
            assert "interrupted" in record["reason"], record
            late = admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "approve"})
            assert late.status_code == 409, late.text

            # The call was refused, never run: its audit event says so.
            def calls() -> list[dict[str, Any]]:
                listed = api.get("/v1/audit", params={"session_id": sid, "kind": "tool.call"})
                return list(listed.json()["events"])

            assert eventually(lambda: len(calls()) == 1)
            assert calls()[0]["status"] == "denied", calls()
        finally:
            api.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("gated", ["execution", "command"])
def test_a_session_ending_lets_a_call_waiting_at_its_gate_go_at_once(
    governed_server: Server, add_key: Callable[..., str], pool: ThreadPoolExecutor, gated: str
) -> None:
    flag = "--approve-executions" if gated == "execution" else "--approve-commands"
    key = add_key(unique_name(f"gated-{gated}"), flag)
    with governed_server.client(key) as api:
        created = api.post("/v1/sessions", json={"backend": "local"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        if gated == "execution":
            path, body = f"/v1/sessions/{sid}/execute", {"code": "print('ran')"}
        else:
            path, body = f"/v1/sessions/{sid}/commands", {"command": "echo ran"}
        waiting = pool.submit(lambda: api.post(path, json=body, timeout=120))
        pending = pending_of(api, sid)
        assert not waiting.done()
        started = time.monotonic()
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        answered = waiting.result(timeout=30)
        assert time.monotonic() - started < 10, "the caller waited on for a session that ended"
        assert answered.status_code == 403, answered.text
        assert answered.json()["error"]["type"] == "ApprovalDenied"
        assert "session ended" in answered.json()["error"]["message"]
        assert "ran" not in answered.text
        record = api.get(f"/v1/approvals/{pending['id']}").json()
        assert record["state"] == "expired" and record["decided_by"] == "abandoned", record
