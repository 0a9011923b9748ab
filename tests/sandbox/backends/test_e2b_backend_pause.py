"""The e2b backend pauses with E2B's own pause (the whole sandbox, not a saved namespace), driven
through E2B's SDK against our own front on 127.0.0.1; and a service using it keeps its sessions
across a SIGKILL by pausing their sandboxes at E2B instead of killing them."""

from __future__ import annotations

import shutil
import signal

import httpx

from code_interpreter_wire.spec import SandboxSpec
from sandbox import Backend
from sandbox.backends.e2b_cloud import ORCHESTRATOR_LABEL
from tests.e2b_sdk_fixtures import E2B_VARIABLES
from tests.orchestrator.service.conftest import KEY_A, Server, make_server
from tests.sandbox.backends.test_e2b_backend import e2b_backend  # noqa: F401 - a fixture


async def test_suspend_pauses_at_e2b_and_wake_brings_the_same_sandbox_back(
    e2b_backend: Backend,  # noqa: F811 - the fixture
    e2b_server: Server,
) -> None:
    spec = SandboxSpec(default_timeout_s=60)
    sandbox = await e2b_backend.create(spec)
    handle = None
    try:
        assert (await sandbox.execute("import threading; kept = 41; t = threading.Lock()")).ok
        handle = await sandbox.suspend()
        assert handle == sandbox.id
        async with httpx.AsyncClient(base_url=e2b_server.url, headers={"X-API-Key": KEY_A}) as api:
            info = (await api.get(f"/sandboxes/{handle}")).json()
            assert info["state"] == "paused", info
        woken = await e2b_backend.wake(handle, spec)
        try:
            # A lock is no object a namespace snapshot keeps; a paused sandbox keeps it all.
            done = await woken.execute("print(kept + 1, type(t).__name__)")
            assert done.stdout.split() == ["42", "lock"], done
        finally:
            await woken.close()
    finally:
        await sandbox.close()


def test_a_service_on_e2b_pauses_whole_and_keeps_sessions_across_a_crash(
    e2b_server: Server,
) -> None:
    chained = make_server(
        backends="e2b",
        default_backend="e2b",
        e2b_api_key=KEY_A,
        e2b_api_url=e2b_server.url,
        e2b_sandbox_url=e2b_server.url,
    )
    for name in E2B_VARIABLES:
        chained.env.pop(name, None)
    chained.start()
    try:
        with chained.client() as api:
            sid = api.post("/v1/sessions", json={}).json()["id"]
            code = {"code": "import threading; lock = threading.Lock(); n = 1"}
            assert api.post(f"/v1/sessions/{sid}/execute", json=code).json()["status"] == "ok"
            assert api.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
            back = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(n, lock)"})
            body = back.json()
            assert (
                "unlocked" in body["stdout"]
                and "paused and resumed by its backend" in body["notice"]
            ), body
            api.post(f"/v1/sessions/{sid}/execute", json={"code": "n = 2"})
        chained.stop(signal.SIGKILL)
        chained.start()
        with chained.client() as api:
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
            after = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(n, lock)"})
            body = after.json()
            assert body["stdout"].split()[0] == "2" and body["state_lost"] is False, body
            assert "kept whole" in body["notice"]
            # Deleted while paused: its paused sandbox at E2B is deleted too.
            assert api.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        with httpx.Client(base_url=e2b_server.url, headers={"X-API-Key": KEY_A}) as e2b:
            labels = [(s.get("metadata") or {}) for s in e2b.get("/v2/sandboxes").json()]
        ours = [m for m in labels if m.get(ORCHESTRATOR_LABEL) == chained.orchestrator_id]
        assert ours == []  # nothing of it is left at E2B, running or paused
    finally:
        chained.stop()
        shutil.rmtree(chained.state_dir.parent, ignore_errors=True)
