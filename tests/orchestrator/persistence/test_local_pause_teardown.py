"""A local session's pause through a real service: when the pause answers, no process of the
session runs (a background process and a daemon its kernel started included) and its sandbox is
gone; a resume right after brings its state back in a new sandbox; a shutdown leaves nothing."""

from __future__ import annotations

import shutil
import signal
import uuid

import httpx
import pytest

from tests.conftest import backend_unavailable, host_processes_with
from tests.orchestrator.service.conftest import leftovers, make_server

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(backend_unavailable("local") is not None, reason="no local backend"),
]


def run(api: httpx.Client, sid: str, code: str) -> str:
    done = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 120})
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "ok", done.json()
    return str(done.json()["stdout"])


def test_a_local_pause_stops_every_process_and_resumes_at_once() -> None:
    marker = f"cir-pause-{uuid.uuid4().hex}"
    server = make_server(backends="local", default_backend="local", pool_size=0).start()
    try:
        with server.client() as api:
            created = api.post("/v1/sessions", json={"backend": "local"})
            assert created.status_code == 201, created.text
            sid = created.json()["id"]
            started = api.post(
                f"/v1/sessions/{sid}/processes",
                json={"argv": ["sh", "-c", f"sleep 1000; : {marker}"]},
            )
            assert started.status_code == 201, started.text
            run(
                api,
                sid,
                "import subprocess\n"
                f"subprocess.Popen(['sh', '-c', 'sleep 1001; : {marker}'], "
                "start_new_session=True)\n"
                "kept = 41",
            )
            assert len(host_processes_with(marker)) == 2
            paused = api.post(f"/v1/sessions/{sid}/pause")
            assert paused.status_code == 200, paused.text
            assert host_processes_with(marker) == []
            assert leftovers(server) == []
            resumed = api.post(f"/v1/sessions/{sid}/resume")
            assert resumed.status_code == 200, resumed.text
            assert resumed.json()["session"]["state"] == "running"
            assert run(api, sid, "print(kept + 1)") == "42\n"
            assert api.get(f"/v1/sessions/{sid}/processes").json() == []
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        assert server.stop() in (0, -signal.SIGTERM)
        assert leftovers(server) == []
    finally:
        if server.process is not None and server.process.poll() is None:
            server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)
