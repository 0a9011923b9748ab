"""Host tools from a wasm session (docs/wasm.md): the model's code in Pyodide calls the host's
tools, awaited or blocking, through the service's relay with the same checks, policy and human
approval as from a kernel; a time limit ends a call that waits, and the interpreter's state
stays. A served service on 127.0.0.1, real Deno and Pyodide."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import require_backend
from tests.orchestrator.governance.test_approvals import (
    execute,
    in_background,
    name_of,
    wait_pending,
)
from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

pytestmark = pytest.mark.timeout(180)
ADMIN_KEY = "admin-" + uuid.uuid4().hex
TOOLS = {
    "python": [
        "tests.orchestrator.governance.approval_tools:TOOLS",
        "tests.orchestrator.host_tools.tools_for_tests:slow",
    ],
    "call_timeout_s": 20,
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    require_backend("wasm")
    srv = make_server(
        backends="wasm",
        default_backend="wasm",
        host_tools=json.dumps(TOOLS),
        admin_keys=ADMIN_KEY,
        approval_timeout_s=20,
    ).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


def new_session(server: Server, tools: list[str]) -> str:
    with server.client(KEY_A) as api:
        created = api.post("/v1/sessions", json={"backend": "wasm", "tools": tools})
        assert created.status_code == 201, created.text
        sid: str = created.json()["id"]
        return sid


def test_tools_are_called_awaited_blocking_and_many_at_once(server: Server) -> None:
    sid = new_session(server, ["add"])
    with server.client(KEY_A) as api:
        code = (
            "import asyncio, host_tools\n"
            "many = await asyncio.gather(*[host_tools.add(i, i) for i in range(20)])\n"
            "await host_tools.add(2, 3), host_tools.sync.add(4, 5), sum(many)"
        )
        ran = execute(api, sid, code)
        assert ran.json()["results"][0]["text"] == "(5, 9, 380)", ran.text
        wrong = execute(
            api,
            sid,
            "try:\n    host_tools.sync.add('x')\nexcept host_tools.ToolArgumentError as e:\n"
            "    print('refused:', e)\n"
            "try:\n    host_tools.sync.send_money('bob', 1)\n"
            "except AttributeError as e:\n    print('not here:', e)",
        )
        assert "refused: add()" in wrong.json()["stdout"], wrong.text
        assert "not here: host_tools has no tool 'send_money'" in wrong.json()["stdout"]
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def test_a_call_waits_for_a_humans_approval_and_a_denial_raises(
    server: Server, background: ThreadPoolExecutor
) -> None:
    sid = new_session(server, ["send_money"])
    with server.client(KEY_A) as api, server.client(ADMIN_KEY) as admin:
        code = "import host_tools\nhost_tools.sync.send_money('bob', 5, memo='lunch')"
        running = in_background(background, lambda: execute(api, sid, code))
        [pending] = wait_pending(api, sid, "send_money")
        assert pending["arguments"] == {"to": "bob", "amount": 5, "memo": "lunch"}
        assert pending["code"] == code  # the wasm run is the call's origin
        approved = admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "approve"})
        assert approved.status_code == 200, approved.text
        body = running.result(timeout=60).json()
        assert body["results"][0]["text"] == "'sent 5 to bob'", body
        assert body["approvals"][0]["decided_by"] == name_of(server, ADMIN_KEY)

        denied_code = (
            "try:\n    await host_tools.send_money('mallory', 1000)\n"
            "except host_tools.ToolDenied as e:\n    print('DENIED', e)"
        )
        running = in_background(background, lambda: execute(api, sid, denied_code))
        [pending] = wait_pending(api, sid, "send_money")
        admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "deny", "reason": "no"})
        out = running.result(timeout=60).json()
        assert out["stdout"].startswith("DENIED") and "no" in out["stdout"], out
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def test_a_time_limit_ends_a_call_that_waits_and_the_state_stays(server: Server) -> None:
    sid = new_session(server, ["slow"])
    with server.client(KEY_A) as api:
        assert execute(api, sid, "kept = 41").json()["status"] == "ok"
        ran = api.post(
            f"/v1/sessions/{sid}/execute",
            json={"code": "import host_tools\nhost_tools.sync.slow(60)", "timeout_s": 2},
        ).json()
        assert ran["status"] == "timeout" and not ran["state_lost"], json.dumps(ran)
        after = execute(api, sid, "kept + 1").json()
        assert after["results"][0]["text"] == "42", after
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204
