"""Every host-tool call is made for the execution (or command, background process) that started
the calling thread, task or process, and only while that one runs: a thread an execution left
running is refused once its execution has ended, whatever runs then, and nothing is published
for a human to approve; a call a command makes shows a human the command's line, not the code
an execution runs beside it. A real `serve` on 127.0.0.1, real kernels (local backend)."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.orchestrator.governance.conftest import eventually
from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

ADMIN_KEY = "admin-" + uuid.uuid4().hex
TOOLS = {
    "python": ["tests.orchestrator.governance.approval_tools:TOOLS"],
    "session_default": ["add"],
    "call_timeout_s": 10,
}
REFUSED = "ToolDenied: {tool}: no execution running: the execution that started the caller (exec-"

# Threads (and a task) that wait for the file `go`, then call a tool, and write what they got.
STRAYS = """
import asyncio, os, threading, time, host_tools

def outcome(call):
    try:
        return repr(call())
    except host_tools.ToolError as e:
        return f"{type(e).__name__}: {e}"

def stray(name, call):
    while not os.path.exists("go"):
        time.sleep(0.05)
    got = outcome(call)
    with open(name, "w") as f:
        f.write(got)

for name, call in [
    ("thread-add.txt", lambda: host_tools.sync.add(1, 2)),
    ("thread-send.txt", lambda: host_tools.sync.send_money("eve", 9)),
]:
    threading.Thread(target=stray, args=(name, call), daemon=True).start()

async def task():
    while not os.path.exists("go"):
        await asyncio.sleep(0.05)
    try:
        got = repr(await host_tools.add(3, 4))
    except host_tools.ToolError as e:
        got = f"{type(e).__name__}: {e}"
    with open("task-add.txt", "w") as f:
        f.write(got)

asyncio.ensure_future(task())
print("started")
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    import json

    srv = make_server(
        backends="local",
        default_backend="local",
        host_tools=json.dumps(TOOLS),
        admin_keys=ADMIN_KEY,
        approval_timeout_s=10,
    ).start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as running:
        yield running


def new_session(api: httpx.Client) -> str:
    created = api.post("/v1/sessions", json={"tools": ["send_money", "add"]})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def execute(api: httpx.Client, sid: str, code: str) -> dict[str, Any]:
    ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": code}, timeout=120)
    assert ran.status_code == 200, ran.text
    body: dict[str, Any] = ran.json()
    return body


def upload(api: httpx.Client, sid: str, path: str) -> None:
    done = api.post(f"/v1/sessions/{sid}/files", params={"path": path}, files={"file": b"1"})
    assert done.status_code == 201, done.text


def read_when_there(api: httpx.Client, sid: str, path: str, within_s: float = 60) -> str:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        got = api.get(f"/v1/sessions/{sid}/files/{path}")
        if got.status_code == 200:
            return got.text
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear in {sid} within {within_s} s")


def approvals_of(api: httpx.Client, sid: str) -> list[dict[str, Any]]:
    listed = api.get("/v1/approvals", params={"session_id": sid})
    assert listed.status_code == 200, listed.text
    return list(listed.json())


def tool_calls(api: httpx.Client, sid: str, count: int) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]]:
        listed = api.get("/v1/audit", params={"session_id": sid, "kind": "tool.call"})
        return list(listed.json()["events"])

    assert eventually(lambda: len(found()) >= count, within_s=30), found()
    return found()


def test_a_thread_of_an_ended_execution_is_refused_while_another_runs(server: Server) -> None:
    """Execution 2 runs harmless code while a thread execution 1 left calls a tool that waits
    for a human: the call is refused at once, and no request shows execution 2's code."""
    with server.client(KEY_A) as api:
        sid = new_session(api)
        try:
            assert execute(api, sid, STRAYS)["stdout"] == "started\n"
            harmless = (
                "import os, time\n"
                "open('go', 'w').close()\n"
                "while not os.path.exists('thread-send.txt'):\n"
                "    time.sleep(0.05)\n"
                "print(open('thread-send.txt').read())\n"
            )
            started = time.monotonic()
            second = execute(api, sid, harmless)
            assert second["status"] == "ok", second
            assert REFUSED.format(tool="send_money") in second["stdout"], second["stdout"]
            assert "has ended" in second["stdout"], second["stdout"]
            assert time.monotonic() - started < 8  # refused at once, not after a wait
            assert approvals_of(api, sid) == []  # nothing was published for anyone to approve
        finally:
            api.delete(f"/v1/sessions/{sid}")


# A thread that waits for the file `go`, then runs a tool call in a child started with
# `os.system` (which no hook of the kernel reaches): the child inherits the kernel's environment.
SYSTEM_STRAY = """
import os, threading, time
with open("call.py", "w") as f:
    f.write(
        "import os, sys\\n"
        "sys.path.insert(0, os.environ['CIR_HOST_TOOLS_DIR'])\\n"
        "import host_tools\\n"
        "try:\\n"
        "    print(repr(host_tools.sync.send_money('eve', 9)))\\n"
        "except host_tools.ToolError as e:\\n"
        "    print(f'{type(e).__name__}: {e}')\\n"
    )
def stray():
    while not os.path.exists("go"):
        time.sleep(0.05)
    os.system("python3 call.py > system.part && mv system.part system-send.txt")
threading.Thread(target=stray, daemon=True).start()
print("started")
"""


def test_a_child_an_ended_executions_thread_starts_with_os_system_is_refused(
    server: Server,
) -> None:
    """The child of `os.system` names no origin at all (the kernel's environment holds none),
    so its call is refused at once while execution 2 runs, never shown as execution 2's."""
    with server.client(KEY_A) as api:
        sid = new_session(api)
        try:
            assert execute(api, sid, SYSTEM_STRAY)["stdout"] == "started\n"
            harmless = (
                "import os, time\n"
                "open('go', 'w').close()\n"
                "while not os.path.exists('system-send.txt'):\n"
                "    time.sleep(0.05)\n"
                "print(open('system-send.txt').read())\n"
            )
            started = time.monotonic()
            second = execute(api, sid, harmless)
            assert second["status"] == "ok", second
            assert second["stdout"].startswith(
                "ToolDenied: send_money: no execution running: the call names none"
            ), second["stdout"]
            assert time.monotonic() - started < 8  # refused at once, not after a wait
            assert approvals_of(api, sid) == []  # nothing was published for anyone to approve
            [call] = tool_calls(api, sid, 1)
            assert call["status"] == "denied" and call["details"]["origin"] is None, call
        finally:
            api.delete(f"/v1/sessions/{sid}")


def test_calls_from_threads_and_tasks_after_every_execution_ended_are_refused(
    server: Server,
) -> None:
    """The rule holds for every call, one that needs no approval as well, from a thread or an
    asyncio task, while nothing runs in the session."""
    with server.client(KEY_A) as api:
        sid = new_session(api)
        try:
            first = execute(api, sid, STRAYS)
            assert first["stdout"] == "started\n", first
            upload(api, sid, "go")  # no execution runs now
            for name, tool in [
                ("thread-add.txt", "add"),
                ("thread-send.txt", "send_money"),
                ("task-add.txt", "add"),
            ]:
                got = read_when_there(api, sid, name)
                assert got.startswith(REFUSED.format(tool=tool)), (name, got)
            assert approvals_of(api, sid) == []
            calls = tool_calls(api, sid, 3)
            assert {c["status"] for c in calls} == {"denied"}, calls
            assert all(c["details"]["origin"].startswith("exec-") for c in calls), calls
            # A call within its own execution still runs, and names that execution.
            ordinary = execute(api, sid, "import host_tools\nhost_tools.sync.add(2, 3)")
            assert ordinary["results"][0]["text"] == "5", ordinary
            newest = tool_calls(api, sid, 4)[0]
            assert newest["status"] == "ok" and newest["details"]["origin"].startswith("exec-")
        finally:
            api.delete(f"/v1/sessions/{sid}")


TOOL_COMMAND = (
    "python3 -c \"import os, sys; sys.path.insert(0, os.environ['CIR_HOST_TOOLS_DIR']); "
    "import host_tools; print(host_tools.sync.send_money('carol', 3))\""
)


def test_a_commands_call_shows_the_command_not_the_execution_beside_it(
    server: Server, pool: ThreadPoolExecutor
) -> None:
    with server.client(KEY_A) as api, server.client(ADMIN_KEY) as admin:
        sid = new_session(api)
        try:
            beside = (
                "import os, time\n"
                "open('started', 'w').close()\n"
                "while not os.path.exists('go'):\n"
                "    time.sleep(0.05)\n"
                "print('the execution beside it ended')\n"
            )
            running = pool.submit(execute, api, sid, beside)
            read_when_there(api, sid, "started")  # the execution runs now
            command = pool.submit(
                lambda: api.post(
                    f"/v1/sessions/{sid}/commands", json={"command": TOOL_COMMAND}, timeout=120
                )
            )
            assert eventually(lambda: len(approvals_of(api, sid)) == 1, within_s=60)
            [pending] = approvals_of(api, sid)
            assert pending["state"] == "pending", pending
            assert "send_money('carol', 3)" in pending["code"], pending
            assert "the execution beside it" not in pending["code"], pending
            answered = admin.post(f"/v1/approvals/{pending['id']}", json={"decision": "approve"})
            assert answered.status_code == 200, answered.text
            ran = command.result(timeout=60)
            assert ran.status_code == 200, ran.text
            assert ran.json()["stdout"] == "sent 3 to carol\n", ran.json()
            upload(api, sid, "go")
            assert running.result(timeout=60)["stdout"] == "the execution beside it ended\n"
            [call] = tool_calls(api, sid, 1)
            assert call["status"] == "ok" and call["details"]["origin"].startswith("command-")
        finally:
            api.delete(f"/v1/sessions/{sid}")


def test_a_background_process_calls_while_it_runs(server: Server) -> None:
    with server.client(KEY_A) as api:
        sid = new_session(api)
        try:
            line = TOOL_COMMAND.replace("send_money('carol', 3)", "add(20, 22)")
            started = api.post(f"/v1/sessions/{sid}/processes", json={"command": line})
            assert started.status_code == 201, started.text
            pid = started.json()["pid"]
            done = api.post(f"/v1/sessions/{sid}/processes/{pid}/wait", timeout=60)
            assert done.status_code == 200, done.text
            assert done.json()["stdout"] == "42\n", done.json()
            [call] = tool_calls(api, sid, 1)
            assert call["status"] == "ok" and call["details"]["origin"].startswith("process-")
        finally:
            api.delete(f"/v1/sessions/{sid}")
