"""A caller that leaves while its run waits for a human's approval takes the wait with it: the
request ends `expired` (decided by "abandoned"), no later answer can approve it, and nothing
starts: for background processes, streamed commands, executions and streamed executions (a
whole command is held the same way as an execution: `unless_disconnected`)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.orchestrator.governance.conftest import ADMIN_KEY, eventually, unique_name
from tests.orchestrator.service.conftest import Server

MARKER = "started-after-all"
COMMAND = {"command": f"touch {MARKER}"}
CODE = {"code": f"open({MARKER!r}, 'w').close()"}
# (route, what the key's policy gates, body): every way a run starts over REST that may wait.
GATED = [
    ("processes", "--approve-commands", COMMAND),
    ("commands/stream", "--approve-commands", COMMAND),
    ("execute", "--approve-executions", CODE),
    ("execute/stream", "--approve-executions", CODE),
]


def send_and_hold(server: Server, key: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A POST sent on a socket of its own, left open: the caller, until it is closed."""
    where = urlsplit(server.url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    caller = socket.create_connection((where.hostname or "127.0.0.1", where.port or 80))
    caller.sendall(head.encode() + data)
    return caller


def pending_in(api: httpx.Client, session_id: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def listed() -> bool:
        answer = api.get("/v1/approvals", params={"state": "pending", "session_id": session_id})
        assert answer.status_code == 200, answer.text
        found[:] = answer.json()
        return bool(found)

    assert eventually(listed, within_s=30), f"no pending approval in {session_id}"
    [record] = found
    return record


@pytest.mark.parametrize(("route", "gate", "body"), GATED, ids=[g[0] for g in GATED])
def test_a_caller_gone_during_its_approval_wait_leaves_nothing_to_approve_or_run(
    governed_server: Server,
    add_key: Callable[..., str],
    route: str,
    gate: str,
    body: dict[str, Any],
) -> None:
    key = add_key(unique_name("leaver"), gate)
    with governed_server.client(key) as api, governed_server.client(ADMIN_KEY) as admin:
        created = api.post("/v1/sessions", json={"backend": "local"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            caller = send_and_hold(governed_server, key, f"/v1/sessions/{sid}/{route}", body)
            pending = pending_in(api, sid)
            caller.close()  # the client leaves while its run waits for a human

            def state() -> dict[str, Any]:
                return dict(api.get(f"/v1/approvals/{pending['id']}").json())

            assert eventually(lambda: state()["state"] != "pending", within_s=10), state()
            record = state()
            assert record["state"] == "expired" and record["decided_by"] == "abandoned", record
            late = admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "approve"})
            assert late.status_code == 409, late.text
            files = api.get(f"/v1/sessions/{sid}/files")
            assert files.status_code == 200, files.text
            assert MARKER not in {f["path"] for f in files.json()}, files.json()
            listed = api.get(f"/v1/sessions/{sid}/processes", params={"include_ended": True})
            assert listed.status_code == 200 and listed.json() == [], listed.text
        finally:
            api.delete(f"/v1/sessions/{sid}")
