"""The audit log end to end: a real server (`code-interpreter serve`) on 127.0.0.1 with real
sandboxes (local backend: recording is the service's, the same for every backend), its API and
its CLI (in this process, and as another process beside the live service), a SIGKILL and a
restart on the same state dir; the service's retention sweep, in this process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.rest import CreateSessionRequest
from orchestrator.cli import app as cli_app
from orchestrator.config import Settings
from orchestrator.governance import audit_kinds
from orchestrator.governance.stores.audit_store import AuditQuery
from orchestrator.service import Service
from tests.orchestrator.governance.conftest import ADMIN_KEY
from tests.orchestrator.service.conftest import (
    KEY_A,
    KEY_B,
    Server,
    free_port,
    leftovers,
    make_server,
)

CLI = [sys.executable, "-m", "orchestrator", "audit"]
CODE_CAP = 65_536  # the default audit_max_code_chars
SCRIPTED = [
    "session.created",
    "execution",
    "command",
    "file.upload",
    "file.download",
    "file.remove",
    "execution",
    "session.ended",
]


def local_server(**settings: object) -> Server:
    return make_server(backends="local", default_backend="local", admin_keys=ADMIN_KEY, **settings)


@pytest.fixture(scope="module")
def server(governed_server: Server) -> Server:
    """The governance tests' shared server."""
    return governed_server


def name_of(srv: Server, key: str) -> str:
    with srv.client(key) as api:
        return str(api.get("/v1/whoami").json()["name"])


def events(api: httpx.Client, **params: Any) -> list[dict[str, Any]]:
    reply = api.get("/v1/audit", params={"limit": 1000, **params})
    assert reply.status_code == 200, reply.text
    found: list[dict[str, Any]] = reply.json()["events"]
    return found


def wait_for(api: httpx.Client, kind: str, **params: Any) -> list[dict[str, Any]]:
    """The events `params` select, once one of `kind` is among them (written in the background:
    polled, with a deadline)."""
    deadline = time.monotonic() + 15
    while True:
        found = events(api, **params)
        if any(e["kind"] == kind for e in found):
            return found
        assert time.monotonic() < deadline, f"no {kind} event: {found}"
        time.sleep(0.05)


def execute(api: httpx.Client, sid: str, code: str) -> dict[str, Any]:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


def scripted_session(api: httpx.Client) -> str:
    """Create, execute, a command, upload, download, remove, a failing execution, end."""
    created = api.post("/v1/sessions", json={"backend": "local"})
    assert created.status_code == 201, created.text
    sid: str = created.json()["id"]
    assert execute(api, sid, "x = 1 + 1\nprint(x)")["stdout"] == "2\n"
    ran = api.post(f"/v1/sessions/{sid}/commands", json={"command": "echo audited"})
    assert ran.status_code == 200 and ran.json()["exit_code"] == 0, ran.text
    up = api.post(f"/v1/sessions/{sid}/files?path=data.txt", files={"file": b"12345"})
    assert up.status_code == 201, up.text
    assert api.get(f"/v1/sessions/{sid}/files/data.txt").content == b"12345"
    assert api.delete(f"/v1/sessions/{sid}/files/data.txt").status_code == 204
    assert execute(api, sid, "1 / 0")["error"]["name"] == "ZeroDivisionError"
    assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    return sid


@pytest.fixture(scope="module")
def scripted(server: Server) -> str:
    with server.client(KEY_A) as api:
        sid = scripted_session(api)
        wait_for(api, "session.ended", session_id=sid)
    return sid


def test_a_scripted_session_leaves_every_event_with_key_session_and_time_in_order(
    server: Server, scripted: str
) -> None:
    name = name_of(server, KEY_A)
    with server.client(KEY_A) as api:
        found = list(reversed(events(api, session_id=scripted)))
    assert [e["kind"] for e in found] == SCRIPTED
    assert {e["principal"] for e in found} == {name}
    assert {e["session_id"] for e in found} == {scripted}
    times = [e["time"] for e in found]
    assert times == sorted(times) and time.time() - times[0] < 300
    seqs = [e["seq"] for e in found]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    created, ok, command, upload, download, remove, failed, ended = found
    assert created["details"]["backend"] == "local"
    assert ok["status"] == "ok" and ok["duration_s"] > 0
    assert ok["details"]["code"] == "x = 1 + 1\nprint(x)"
    assert ok["details"]["language"] == "python" and ok["details"]["stdout_chars"] == 2
    assert ok["details"]["execution_id"]
    assert command["status"] == "ok" and command["details"]["command"] == "echo audited"
    assert command["details"]["exit_code"] == 0 and command["details"]["stdout_chars"] == 8
    assert upload["details"] == {"path": "data.txt", "bytes": 5}
    assert download["details"] == {"path": "data.txt", "bytes": 5}
    assert remove["details"]["path"] == "data.txt"
    assert failed["status"] == "error" and failed["details"]["error"] == "ZeroDivisionError"
    assert ended["status"] == "deleted" and ended["details"]["why"] == "was deleted"


def test_another_key_cannot_read_them_and_an_admin_key_can(server: Server, scripted: str) -> None:
    owner_name = name_of(server, KEY_A)
    with server.client(KEY_B) as other:
        assert events(other, session_id=scripted) == []
        assert all(e["principal"] != owner_name for e in events(other))
        refused = other.get("/v1/audit", params={"key": owner_name})
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "PolicyDenied"
        assert "only an admin key" in refused.json()["error"]["message"]
        exported = other.get("/v1/audit/export", params={"session_id": scripted})
        assert exported.status_code == 200 and exported.text == ""
        assert other.get("/v1/audit/export", params={"key": owner_name}).status_code == 403
    with server.client(None) as anonymous:
        assert anonymous.get("/v1/audit").status_code == 401
    with server.client(ADMIN_KEY) as admin:
        assert [e["kind"] for e in reversed(events(admin, session_id=scripted))] == SCRIPTED
        by_name = events(admin, key=owner_name, session_id=scripted)
        assert len(by_name) == len(SCRIPTED)
        assert events(admin, key=name_of(server, KEY_B), session_id=scripted) == []


def test_filters_paging_and_export_as_json_lines(server: Server, scripted: str) -> None:
    with server.client(KEY_A) as api:
        mine = events(api, session_id=scripted)
        only = events(api, session_id=scripted, kind="execution,command")
        assert [e["kind"] for e in only] == ["execution", "command", "execution"]
        repeated = api.get(
            "/v1/audit",
            params=[("session_id", scripted), ("kind", "file.upload"), ("kind", "file.remove")],
        ).json()["events"]
        assert [e["kind"] for e in repeated] == ["file.remove", "file.upload"]
        # Time: epoch seconds or ISO 8601; `since` inclusive, `until` exclusive.
        middle = mine[3]["time"]
        iso = (
            time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle))
            + f".{int(middle % 1 * 1e6):06d}Z"
        )
        later = events(api, session_id=scripted, since=iso)
        assert later == mine[:4]
        assert events(api, session_id=scripted, until=str(middle)) == mine[4:]
        # Pages of 3 with the cursor: the same events, each once.
        paged: list[dict[str, Any]] = []
        params: dict[str, Any] = {"session_id": scripted, "limit": 3}
        while True:
            body = api.get("/v1/audit", params=params).json()
            paged += body["events"]
            if body["next"] is None:
                break
            params["before"] = body["next"]
        assert paged == mine
        # Export: one JSON object a line, the same events.
        with api.stream("GET", "/v1/audit/export", params={"session_id": scripted}) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("application/x-ndjson")
            lines = list(reply.iter_lines())
        assert [json.loads(line) for line in lines] == mine
        capped = api.get("/v1/audit/export", params={"session_id": scripted, "limit": 2})
        assert len(capped.text.splitlines()) == 2
        # Bad filters say what is wrong.
        bad_kind = api.get("/v1/audit", params={"kind": "exec"})
        assert (
            bad_kind.status_code == 400 and "the kinds are" in bad_kind.json()["error"]["message"]
        )
        bad_time = api.get("/v1/audit", params={"since": "yesterday"})
        assert bad_time.status_code == 400 and "not a time" in bad_time.text
        assert api.get("/v1/audit", params={"limit": 5000}).status_code == 422


def test_code_over_the_cap_is_kept_truncated_and_marked(server: Server) -> None:
    code = "# " + "x" * 70_000 + "\nprint('ran')"
    with server.client(KEY_A) as api:
        sid = api.post("/v1/sessions", json={"backend": "local"}).json()["id"]
        try:
            assert execute(api, sid, code)["stdout"] == "ran\n"
            found = wait_for(api, "execution", session_id=sid)
        finally:
            api.delete(f"/v1/sessions/{sid}")
    details = next(e for e in found if e["kind"] == "execution")["details"]
    assert details["code"] == code[:CODE_CAP]
    assert details["code_truncated"] is True and details["code_chars"] == len(code)


def cli(*args: str) -> tuple[int, str, str]:
    """`code-interpreter audit ARGS`, in this process: (exit code, stdout, stderr)."""
    result = CliRunner().invoke(cli_app, ["audit", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_the_log_survives_a_sigkill_and_is_read_by_a_new_service_and_the_cli() -> None:
    first = local_server()
    first.start()
    state = first.state_dir
    try:
        with first.client(KEY_A) as api:
            sid = api.post("/v1/sessions", json={}).json()["id"]
            execute(api, sid, "print('before the kill')")
            before = wait_for(api, "execution", session_id=sid)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        assert [e["kind"] for e in before] == ["execution", "session.created"]

        # The CLI reads the file the dead service left.
        code, out, err = cli("list", "--state-dir", str(state), "--session", sid, "--json")
        assert code == 0, err
        assert [json.loads(line) for line in out.splitlines()] == before
        code, out, _ = cli("list", "--state-dir", str(state), "--kind", "execution")
        assert code == 0 and "before the kill" in out and "key-" in out, out

        # A new service on the same state dir reads them too, and goes on after them.
        second = Server(f"http://127.0.0.1:{free_port()}", first.env, state, first.orchestrator_id)
        second.start()
        try:
            with second.client(KEY_A) as api:
                assert events(api, session_id=sid)[-2:] == before
                new = api.post("/v1/sessions", json={}).json()["id"]
                api.delete(f"/v1/sessions/{new}")
                after = wait_for(api, "session.ended", session_id=new)
                assert min(e["seq"] for e in after) > max(e["seq"] for e in before)
            # Another process reads while the service runs (WAL: each sees the other's writes).
            exported = subprocess.run(
                [*CLI, "export", "--state-dir", str(state), "--session", sid],
                capture_output=True,
                text=True,
                timeout=120,
                env=os.environ.copy(),
            )
            assert exported.returncode == 0, exported.stderr
            kept = [json.loads(line) for line in exported.stdout.splitlines()]
            assert kept[-2:] == before
        finally:
            assert second.stop() in (0, -signal.SIGTERM)
        assert leftovers(second) == [], "a sandbox of the killed service was left behind"

        # Pruning from the CLI: nothing is an hour old; everything is older than 0 s.
        assert cli("prune", "--state-dir", str(state), "--older-than", "1h")[1].startswith("0 ")
        code, out, _ = cli("prune", "--state-dir", str(state), "--older-than", "0s")
        assert code == 0 and not out.startswith("0 "), out
        assert cli("list", "--state-dir", str(state))[1] == ""
        code, _, err = cli("list", "--state-dir", str(state / "nowhere"))
        assert code == 2 and "no service state" in err
        code, _, err = cli("prune", "--state-dir", str(state), "--older-than", "soon")
        assert code == 2 and "not an age" in err
    finally:
        shutil.rmtree(state.parent, ignore_errors=True)


@contextlib.asynccontextmanager
async def in_process(state_dir: Path, **settings: Any) -> AsyncIterator[Service]:
    """A service in this process (local backend, no keys), started and closed."""
    running = Service(
        Settings(
            auth_disabled=True,
            backends=["local"],
            default_backend="local",
            state_dir=state_dir,
            **settings,
        )
    )
    await running.start()
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def service(state_dir: Path) -> AsyncIterator[Service]:
    async with in_process(state_dir) as running:
        yield running


async def test_the_services_sweep_deletes_events_past_their_retention(state_dir: Path) -> None:
    # Events kept 1 s; the reaper (and the sweep with it) goes round every 0.1 s.
    async with in_process(state_dir, audit_retention_s=1.0, reap_interval_s=0.1) as service:
        await _swept(service)


async def _swept(service: Service) -> None:
    service.trail.log.record(audit_kinds.KEY_ADDED, owner="local", details={"name": "k"})
    query = AuditQuery(kinds=[audit_kinds.KEY_ADDED])
    deadline = time.monotonic() + 15
    log = service.persistence.governance.audit
    while not await log.query_events(query):
        assert time.monotonic() < deadline, "the event was never written"
        await asyncio.sleep(0.05)
    while await log.query_events(query):  # past 1 s, the next sweep deletes it
        assert time.monotonic() < deadline, "the event outlived its retention"
        await asyncio.sleep(0.1)


async def test_a_pause_a_resume_and_a_background_process_are_recorded(service: Service) -> None:
    session = await service.lifecycle.create("local", CreateSessionRequest())
    started = await service.runs.start_process(session, ProcessRequest(argv=["sleep", "0"]))
    await service.runs.wait_process(session, started.pid)
    await service.lifecycle.pause(session.id, "local")
    await service.lifecycle.resume(session.id, "local")
    await service.lifecycle.end(session.id, "local")
    query = AuditQuery(session_id=session.id)
    deadline = time.monotonic() + 15
    while len(found := await service.persistence.governance.audit.query_events(query)) < 5:
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)
    kinds = [e.kind for e in reversed(found)]
    assert kinds == [
        "session.created",
        "process.started",
        "session.paused",
        "session.resumed",
        "session.ended",
    ]
    process = found[-2]
    assert process.details["command"] == "sleep 0" and process.details["pid"] == started.pid
    assert found[0].status == "deleted"


async def test_with_the_log_off_nothing_is_recorded(state_dir: Path) -> None:
    async with in_process(state_dir, audit_enabled=False) as off:
        off.trail.log.record(audit_kinds.KEY_ADDED, owner="local", details={"name": "k"})
        await off.trail.log.close()  # flushed: what would have been written is now
        assert await off.persistence.governance.audit.query_events(AuditQuery()) == []
