"""Human approval, end to end: a served service (`code-interpreter serve` on 127.0.0.1) whose
sandboxed code calls host tools registered with `requires_approval`; people answer through the
API, the operator's webhook (a real HTTP server here) answers some itself, silence is a denial,
and keys whose policy says so wait before every execution or command."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from tests.orchestrator.governance.conftest import add_key_to, run_keys
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server, leftovers, make_server

ADMIN_KEY = "admin-" + uuid.uuid4().hex
SECRET = "hook-secret-" + uuid.uuid4().hex
TIMEOUT_S = 10  # the server's approval_timeout_s: what "no answer in time" takes
TOOLS = {
    "python": ["tests.orchestrator.governance.approval_tools:TOOLS"],
    "session_default": ["send_money"],
    "call_timeout_s": 10,
}


@dataclass
class Hook:
    """The operator's webhook: keeps what it is sent; decides notify_team calls by their
    message ("deny ..." is denied), acknowledges every other request without deciding."""

    url: str = ""
    received: list[tuple[bytes, str | None]] = field(default_factory=list)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(body) for body, _ in self.received]


@pytest.fixture(scope="module")
def hook() -> Iterator[Hook]:
    found = Hook()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None: ...

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            found.received.append((body, self.headers.get("X-CIR-Signature")))
            approval = json.loads(body)["approval"]
            if approval["subject"] == "notify_team":
                message = approval["arguments"]["message"]
                verdict = "deny" if message.startswith("deny") else "approve"
                answer = json.dumps({"decision": verdict, "reason": f"the hook said {verdict}"})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())
                return
            self.send_response(202)  # told, not decided: a human answers
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    found.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield found
    server.shutdown()


@pytest.fixture(scope="module")
def server(hook: Hook) -> Iterator[Server]:
    srv = make_server(
        backends="local",
        default_backend="local",
        host_tools=json.dumps(TOOLS),
        admin_keys=ADMIN_KEY,
        approval_timeout_s=TIMEOUT_S,
        approval_webhook_url=hook.url,
        approval_webhook_secret=SECRET,
        approval_max_pending_per_session=2,
    ).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def background() -> Iterator[ThreadPoolExecutor]:
    """Requests that wait for an answer run here while the test answers them."""
    with ThreadPoolExecutor(4) as pool:
        yield pool


def name_of(server: Server, key: str) -> str:
    with server.client(key) as api:
        name: str = api.get("/v1/whoami").json()["name"]
        return name


def new_session(api: httpx.Client, tools: list[str]) -> str:
    created = api.post("/v1/sessions", json={"tools": tools})
    assert created.status_code == 201, created.text
    sid: str = created.json()["id"]
    return sid


def wait_pending(
    api: httpx.Client, session_id: str, subject: str, *, count: int = 1, within_s: float = 60
) -> list[dict[str, Any]]:
    """The session's pending requests for `subject`, once there are `count` of them."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        listed = api.get("/v1/approvals", params={"state": "pending", "session_id": session_id})
        assert listed.status_code == 200, listed.text
        found = [r for r in listed.json() if r["subject"] == subject]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no pending request for {subject} in {session_id} within {within_s} s")


def execute(api: httpx.Client, session_id: str, code: str) -> httpx.Response:
    return api.post(f"/v1/sessions/{session_id}/execute", json={"code": code})


def in_background(pool: ThreadPoolExecutor, call: Callable[[], httpx.Response]) -> Future[Any]:
    return pool.submit(call)


DENIED_REPORT = (
    "import host_tools\n"
    "try:\n"
    "    host_tools.sync.send_money('mallory', 1000)\n"
    "except host_tools.ToolDenied as e:\n"
    "    print('DENIED', isinstance(e, PermissionError), isinstance(e, host_tools.ToolError), e)\n"
)


def test_a_call_waits_and_returns_once_approved_over_the_api(
    server: Server, background: ThreadPoolExecutor
) -> None:
    with server.client(KEY_A) as api, server.client(ADMIN_KEY) as admin:
        sid = new_session(api, ["send_money"])
        code = "import host_tools\nhost_tools.sync.send_money('bob', 5, memo='lunch')"
        running = in_background(background, lambda: execute(api, sid, code))
        [pending] = wait_pending(api, sid, "send_money")
        assert not running.done()  # the code waits for the answer
        assert pending["kind"] == "tool_call" and pending["state"] == "pending"
        assert pending["arguments"] == {"to": "bob", "amount": 5, "memo": "lunch"}
        assert pending["code"] == code  # the code that made the call
        assert pending["principal"] == name_of(server, KEY_A)
        assert admin.get(f"/v1/approvals/{pending['id']}").json()["id"] == pending["id"]

        answered = admin.post(
            f"/v1/approvals/{pending['id']}", json={"decision": "approve", "reason": "fine"}
        )
        assert answered.status_code == 200, answered.text
        assert answered.json()["state"] == "approved"
        result = running.result(timeout=60)
        assert result.status_code == 200, result.text
        body = result.json()
        assert body["status"] == "ok", body
        assert body["results"][0]["text"] == "'sent 5 to bob'"
        [waited] = body["approvals"]
        assert waited["subject"] == "send_money" and waited["decision"] == "approved"
        assert waited["decided_by"] == name_of(server, ADMIN_KEY) and waited["reason"] == "fine"
        assert waited["approval_id"] == pending["id"] and waited["waited_s"] > 0

        # One answer wins: the second is refused, saying who decided.
        again = api.post(f"/v1/approvals/{pending['id']}", json={"decision": "deny"})
        assert again.status_code == 409, again.text
        assert again.json()["error"]["type"] == "ApprovalAlreadyDecided"
        assert "approved by " + name_of(server, ADMIN_KEY) in again.json()["error"]["message"]
        decided = api.get("/v1/approvals", params={"state": "approved", "session_id": sid})
        assert [r["id"] for r in decided.json()] == [pending["id"]]

        # The audit log holds the request, the decision and the call (its arguments' digest).
        kinds = "approval.requested,approval.decided,tool.call"
        events = audit_events(api, sid, kinds, count=3)
        by_kind = {e["kind"]: e for e in events}
        assert by_kind["approval.decided"]["status"] == "approved"
        assert by_kind["approval.decided"]["details"]["decided_by"] == name_of(server, ADMIN_KEY)
        call = by_kind["tool.call"]
        canonical = json.dumps(
            {"to": "bob", "amount": 5, "memo": "lunch"}, sort_keys=True, separators=(",", ":")
        ).encode()
        assert call["status"] == "ok" and call["details"]["tool"] == "send_money"
        assert call["details"]["arguments_sha256"] == hashlib.sha256(canonical).hexdigest()
        assert call["details"]["arguments_bytes"] == len(canonical)
        assert call["details"]["approver"] == name_of(server, ADMIN_KEY)
        assert "bob" not in json.dumps(call)  # the arguments themselves are not kept
        api.delete(f"/v1/sessions/{sid}")


def audit_events(
    api: httpx.Client, session_id: str, kinds: str, *, count: int
) -> list[dict[str, Any]]:
    """The session's audit events of these kinds, once `count` are written (in batches)."""
    deadline = time.monotonic() + 30
    while True:
        listed = api.get("/v1/audit", params={"session_id": session_id, "kind": kinds})
        assert listed.status_code == 200, listed.text
        events: list[dict[str, Any]] = listed.json()["events"]
        if len(events) >= count:
            return events
        assert time.monotonic() < deadline, events
        time.sleep(0.05)


def test_a_denial_raises_tool_denied_with_the_reason_and_the_output_says_so(
    server: Server, background: ThreadPoolExecutor
) -> None:
    with server.client(KEY_A) as api:
        sid = new_session(api, ["send_money"])
        invoke = {
            "arguments": {"code": DENIED_REPORT, "session_id": sid},
            "format": "anthropic",
            "call_id": "toolu_1",
        }
        running = in_background(
            background, lambda: api.post("/v1/tools/code_interpreter/invoke", json=invoke)
        )
        [pending] = wait_pending(api, sid, "send_money")
        # A full-access key may answer its own sessions' requests (self_approve).
        denied = api.post(
            f"/v1/approvals/{pending['id']}", json={"decision": "deny", "reason": "not today"}
        )
        assert denied.status_code == 200 and denied.json()["state"] == "denied"
        out = running.result(timeout=60).json()
        text = out["output"]["content"][0]["text"]
        me = name_of(server, KEY_A)
        assert f"DENIED True True send_money was denied by {me}: not today" in text, text
        assert "[approval] send_money waited" in text and f"denied by {me}: not today" in text
        api.delete(f"/v1/sessions/{sid}")


def test_no_answer_in_time_is_a_denial(server: Server) -> None:
    with server.client(KEY_A) as api:
        sid = new_session(api, ["send_money"])
        started = time.monotonic()
        ran = execute(api, sid, DENIED_REPORT)
        took = time.monotonic() - started
        assert ran.status_code == 200, ran.text
        assert f"no one answered within {TIMEOUT_S} s" in ran.json()["stdout"]
        assert "DENIED True True" in ran.json()["stdout"]
        assert TIMEOUT_S <= took < TIMEOUT_S + 20
        [record] = api.get("/v1/approvals", params={"session_id": sid}).json()
        assert record["state"] == "denied" and record["decided_by"] == "timeout"
        [waited] = ran.json()["approvals"]
        assert waited["decided_by"] == "timeout" and waited["waited_s"] >= TIMEOUT_S
        api.delete(f"/v1/sessions/{sid}")


def test_the_webhook_is_told_signed_and_its_answer_decides(server: Server, hook: Hook) -> None:
    with server.client(KEY_A) as api:
        sid = new_session(api, ["notify_team"])
        code = (
            "import host_tools\n"
            "print(host_tools.sync.notify_team('lunch at noon'))\n"
            "try:\n"
            "    host_tools.sync.notify_team('deny this one')\n"
            "except host_tools.ToolDenied as e:\n"
            "    print('DENIED', e)\n"
        )
        ran = execute(api, sid, code)
        assert ran.status_code == 200, ran.text
        out = ran.json()["stdout"]
        assert "posted: lunch at noon" in out
        assert "DENIED notify_team was denied by webhook: the hook said deny" in out
        told = [
            (body, signature)
            for body, signature in hook.received
            if json.loads(body)["approval"]["session_id"] == sid
        ]
        assert len(told) == 2
        for body, signature in told:  # each signed with the secret, over the exact body
            expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
            assert signature == expected
            sent = json.loads(body)
            assert sent["type"] == "approval.requested"
            assert sent["answer"] == f"POST /v1/approvals/{sent['approval']['id']}"
        decided = api.get("/v1/approvals", params={"session_id": sid}).json()
        assert sorted((r["state"], r["decided_by"]) for r in decided) == [
            ("approved", "webhook"),
            ("denied", "webhook"),
        ]
        api.delete(f"/v1/sessions/{sid}")


def test_who_may_see_and_answer(server: Server, background: ThreadPoolExecutor) -> None:
    """A key without self_approve sees its requests but may not answer them (403, naming the
    rule); another key sees nothing of them (404, as for a missing one); an admin answers."""
    bob = add_key_to(server, f"bob-{uuid.uuid4().hex[:6]}", "--no-self-approve")
    with server.client(bob) as api, server.client(KEY_B) as other:
        with server.client(ADMIN_KEY) as admin:
            sid = new_session(api, ["send_money"])
            code = "import host_tools\nhost_tools.sync.send_money('carol', 7)"
            running = in_background(background, lambda: execute(api, sid, code))
            [pending] = wait_pending(api, sid, "send_money")
            url = f"/v1/approvals/{pending['id']}"

            refused = api.post(url, json={"decision": "approve"})
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["type"] == "ApprovalForbidden"
            assert "`self_approve`" in refused.json()["error"]["message"]
            assert other.get(url).status_code == 404
            assert other.post(url, json={"decision": "approve"}).status_code == 404
            assert pending["id"] not in [r["id"] for r in other.get("/v1/approvals").json()]
            assert pending["id"] in [r["id"] for r in admin.get("/v1/approvals").json()]
            bad = admin.post(url, json={"decision": "maybe"})
            assert bad.status_code == 422
            long = admin.post(url, json={"decision": "deny", "reason": "x" * 5000})
            assert long.status_code == 422  # a reason is capped
            assert admin.post(url, json={"decision": "approve"}).status_code == 200
            assert running.result(timeout=60).json()["results"][0]["text"] == "'sent 7 to carol'"
            api.delete(f"/v1/sessions/{sid}")
        assert other.get("/v1/approvals/ap-nope").status_code == 404


def test_a_policy_can_ask_approval_of_any_tool_and_the_wait_is_in_its_time_limit(
    server: Server, background: ThreadPoolExecutor
) -> None:
    carol = add_key_to(server, f"carol-{uuid.uuid4().hex[:6]}", "--approval-tools", "add")
    with server.client(carol) as api, server.client(ADMIN_KEY) as admin:
        sid = new_session(api, ["add"])
        manifest = execute(api, sid, "print(open('/run/host-tools/manifest.json').read())")
        [tool] = json.loads(manifest.json()["stdout"])["tools"]
        assert tool["requires_approval"] is True
        assert tool["timeout_s"] == 10 + TIMEOUT_S  # its own limit, plus the approval's wait
        running = in_background(
            background, lambda: execute(api, sid, "import host_tools\nhost_tools.sync.add(2, 3)")
        )
        [pending] = wait_pending(api, sid, "add")
        assert pending["arguments"] == {"a": 2, "b": 3}
        assert admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "approve"}).is_success
        assert running.result(timeout=60).json()["results"][0]["text"] == "5"
        api.delete(f"/v1/sessions/{sid}")


def test_executions_and_commands_wait_when_the_policy_says_so(
    server: Server, background: ThreadPoolExecutor
) -> None:
    dave = add_key_to(
        server, f"dave-{uuid.uuid4().hex[:6]}", "--approve-executions", "--approve-commands"
    )
    with server.client(dave) as api, server.client(ADMIN_KEY) as admin:
        sid = new_session(api, [])
        code = "open('ran.txt', 'w').write('yes'); 6 * 7"
        running = in_background(background, lambda: execute(api, sid, code))
        [pending] = wait_pending(api, sid, "execution")
        assert pending["kind"] == "execution" and pending["code"] == code
        assert admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "approve"}).is_success
        ran = running.result(timeout=60)
        assert ran.status_code == 200 and ran.json()["results"][0]["text"] == "42"
        [waited] = ran.json()["approvals"]
        assert waited["kind"] == "execution" and waited["decision"] == "approved"

        refused_code = "open('refused.txt', 'w').write('ran')"
        running = in_background(background, lambda: execute(api, sid, refused_code))
        [pending] = wait_pending(api, sid, "execution")
        no = {"decision": "deny", "reason": "not on a Friday"}
        assert admin.post(f"/v1/approvals/{pending['id']}", json=no).is_success
        refused = running.result(timeout=60)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "ApprovalDenied"
        assert "not on a Friday" in refused.json()["error"]["message"]
        files = {f["path"] for f in api.get(f"/v1/sessions/{sid}/files").json()}
        assert "ran.txt" in files and "refused.txt" not in files  # it never ran

        command = {"command": "echo from the shell > shell.txt"}
        running = in_background(
            background, lambda: api.post(f"/v1/sessions/{sid}/commands", json=command)
        )
        [pending] = wait_pending(api, sid, command["command"])
        assert pending["kind"] == "command"
        assert admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "deny"}).is_success
        denied = running.result(timeout=60)
        assert denied.status_code == 403 and denied.json()["error"]["type"] == "ApprovalDenied"
        assert "shell.txt" not in {f["path"] for f in api.get(f"/v1/sessions/{sid}/files").json()}
        api.delete(f"/v1/sessions/{sid}")


def test_waiting_requests_are_capped_per_session(
    server: Server, background: ThreadPoolExecutor
) -> None:
    """The server allows 2 waiting per session: a third call is denied at once, saying why."""
    with server.client(KEY_A) as api:
        sid = new_session(api, ["send_money"])
        code = (
            "import asyncio, os, host_tools\n"
            "async def one(n):\n"
            "    try:\n"
            "        return await host_tools.send_money('x', n)\n"
            "    except host_tools.ToolDenied as e:\n"
            "        return f'denied {n}: {e}'\n"
            "first = [asyncio.ensure_future(one(n)) for n in (1, 2)]\n"
            "for _ in range(600):  # until the test has seen both wait\n"
            "    if os.path.exists('go'):\n"
            "        break\n"
            "    await asyncio.sleep(0.05)\n"
            "open('third.tmp', 'w').write(await one(3))\n"
            "os.replace('third.tmp', 'third.txt')  # whole when seen\n"
            "print(await asyncio.gather(*first))\n"
        )
        running = in_background(background, lambda: execute(api, sid, code))
        waiting = wait_pending(api, sid, "send_money", count=2)
        go = api.post(f"/v1/sessions/{sid}/files", files={"file": ("go", b"")})
        assert go.status_code == 201, go.text
        deadline = time.monotonic() + 60  # the third is refused while the two still wait
        while (third := api.get(f"/v1/sessions/{sid}/files/third.txt")).status_code == 404:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert third.text.startswith("denied 3: send_money was denied: 2 approval requests of"), (
            third.text
        )
        for request in waiting:
            answer = {"decision": "deny", "reason": "no"}
            assert api.post(f"/v1/approvals/{request['id']}", json=answer).is_success
        out = running.result(timeout=60).json()["stdout"]
        assert out.count("was denied by") == 2, out
        assert len(api.get("/v1/approvals", params={"session_id": sid}).json()) == 2
        api.delete(f"/v1/sessions/{sid}")


def test_a_tool_the_policy_no_longer_allows_is_refused_like_one_never_given(
    server: Server,
) -> None:
    """The channel's guard reads the key's policy at each call: a tool taken away from the key
    (keys set-policy) is refused from sandboxed code exactly as a tool the session lacks."""
    name = f"frank-{uuid.uuid4().hex[:6]}"
    frank = add_key_to(server, name, "--tools", "add,send_money")
    with server.client(frank) as api:
        sid = new_session(api, ["add", "send_money"])
        changed = run_keys(server, "set-policy", name, "--tools", "add")
        assert changed.exit_code == 0, changed.stderr
        deadline = time.monotonic() + 30
        while api.get("/v1/whoami").json()["policy"]["host_tools"] != ["add"]:
            assert time.monotonic() < deadline, "the service never read the new policy"
            time.sleep(0.1)
        code = (
            "import host_tools\n"
            "print(host_tools.sync.add(1, 2))\n"
            "try:\n"
            "    host_tools.sync.send_money('x', 1)\n"
            "except host_tools.ToolNotAllowed as e:\n"
            "    print('REFUSED', e)\n"
        )
        out = execute(api, sid, code).json()["stdout"]
        assert out == (
            "3\nREFUSED 'send_money' is not a host tool this session may call (it may call: add)\n"
        ), out
        assert api.get("/v1/approvals", params={"session_id": sid}).json() == []  # none asked
        api.delete(f"/v1/sessions/{sid}")
