"""Session lifetimes and the service's own life: expiry, caps, the pool, shutdown, crashes."""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.orchestrator.service.conftest import (
    KEY_A,
    KEY_B,
    Server,
    leftovers,
    make_server,
    service_backends,
)


@pytest.fixture(scope="module")
def short_server() -> Iterator[Server]:
    """Sessions expire (end, not pause: idle_action=end) after 2 s idle; two per key, three in
    all."""
    srv = make_server(
        idle_timeout_s=2,
        reap_interval_s=0.5,
        max_sessions_per_key=2,
        max_sessions_total=3,
        idle_action="end",
    )
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def capped_server() -> Iterator[Server]:
    """Two sessions per key, three in all, and none expiring while a test holds them: on a busy
    machine three sessions can take longer to start than short_server lets one stay idle."""
    srv = make_server(max_sessions_per_key=2, max_sessions_total=3)
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_idle_sessions_expire_with_a_typed_error(short_server: Server) -> None:
    with short_server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 1"}).status_code == 200
        time.sleep(3.5)
        r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x"})
        assert r.status_code == 410
        assert r.json()["error"]["type"] == "SessionExpired"
        assert "without activity" in r.json()["error"]["message"]
        tool = api.post(
            "/v1/tools/code_interpreter/invoke",
            json={"arguments": {"code": "x", "session_id": sid}, "call_id": "c1"},
        ).json()
        assert tool["status"] == "session_error" and "expired" in tool["output"]["content"]
        assert api.get("/v1/sessions").json() == []


def test_keepalive_and_long_runs_hold_off_expiry(short_server: Server) -> None:
    with short_server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        for _ in range(4):
            time.sleep(1)
            assert api.post(f"/v1/sessions/{sid}/keepalive").status_code == 200
        # A run longer than the idle timeout is activity, not idleness.
        long = api.post(
            f"/v1/sessions/{sid}/execute", json={"code": "import time; time.sleep(4); 'done'"}
        ).json()
        assert long["status"] == "ok" and long["results"][0]["text"] == "'done'"
        assert api.get(f"/v1/sessions/{sid}").status_code == 200
        api.delete(f"/v1/sessions/{sid}")


def test_session_caps_answer_429(capped_server: Server) -> None:
    with capped_server.client(KEY_A) as a, capped_server.client(KEY_B) as b:
        mine = [a.post("/v1/sessions", json={}) for _ in range(3)]
        assert [r.status_code for r in mine] == [201, 201, 429]
        assert "this API key holds its maximum of 2" in mine[2].json()["error"]["message"]
        theirs = [b.post("/v1/sessions", json={}) for _ in range(2)]
        assert [r.status_code for r in theirs] == [201, 429]
        assert "the service holds its maximum of 3" in theirs[1].json()["error"]["message"]
        for r in mine[:2]:
            a.delete(f"/v1/sessions/{r.json()['id']}")
        b.delete(f"/v1/sessions/{theirs[0].json()['id']}")


@pytest.mark.parametrize("backend", service_backends())
def test_pool_hands_over_fresh_sandboxes(server: Server, backend: str) -> None:
    with server.client() as api:
        deadline = time.monotonic() + 60
        while api.get("/v1/status").json()["pools"][backend] < 1:
            assert time.monotonic() < deadline, "the pool did not fill"
            time.sleep(0.1)
        first = api.post("/v1/sessions", json={"backend": backend}).json()
        assert first["from_pool"] is True
        api.post(f"/v1/sessions/{first['id']}/execute", json={"code": "secret = 'of the first'"})
        api.post(f"/v1/sessions/{first['id']}/files", files={"file": ("mine.txt", b"first")})
        api.delete(f"/v1/sessions/{first['id']}")
        while api.get("/v1/status").json()["pools"][backend] < 1:
            assert time.monotonic() < deadline, "the pool did not refill"
            time.sleep(0.1)
        second = api.post("/v1/sessions", json={"backend": backend, "env": {"MINE": "2"}}).json()
        assert second["from_pool"] is True and second["id"] != first["id"]
        r = api.post(
            f"/v1/sessions/{second['id']}/execute",
            json={
                "code": "import os; ('secret' in globals(), os.listdir('.'), os.environ['MINE'])"
            },
        ).json()
        assert r["results"][0]["text"] == "(False, [], '2')"
        api.delete(f"/v1/sessions/{second['id']}")


def test_auth_can_be_turned_off_explicitly() -> None:
    srv = make_server(auth_disabled="true", api_keys="")
    srv.start()
    try:
        with srv.client(key=None) as api:
            sid = api.post("/v1/sessions", json={}).json()["id"]
            assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).status_code == 200
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_a_killed_service_leaves_no_sandbox_and_keeps_its_sessions() -> None:
    srv = make_server()
    srv.start()
    with srv.client() as api:
        ids = [
            api.post("/v1/sessions", json={"backend": b}).json()["id"] for b in service_backends()
        ]

        def busy() -> None:  # a request in flight when the service dies
            with contextlib.suppress(httpx.HTTPError), srv.client() as own:
                own.post(
                    f"/v1/sessions/{ids[0]}/execute", json={"code": "import time; time.sleep(60)"}
                )

        running = threading.Thread(target=busy, daemon=True)
        running.start()
        time.sleep(1)
    assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
    time.sleep(1)
    # The local kernels died with the service (they die with their parent); containers and
    # directories are what a crash leaves.
    left = leftovers(srv)
    assert left, "expected leftovers after SIGKILL"
    srv.start()  # same state dir, same orchestrator id
    try:
        assert leftovers(srv) == []
        with srv.client() as api:
            for sid in ids:  # kept, paused: their files are back, their variables said lost
                assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"
                r = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).json()
                assert r["state_lost"] is True and "restarted" in r["notice"], r
                assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        assert leftovers(srv) == []
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_expired_sessions_leave_no_outputs(short_server: Server) -> None:
    with short_server.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        # long enough to be written to disk (a short one is held in memory)
        code = "print('kept for now' * 2_000)"
        ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
        kept = api.get(f"/v1/sessions/{sid}/executions/{ran.json()['execution_id']}")
        assert kept.status_code == 200, kept.text  # answered once written
        outputs = short_server.state_dir / "outputs" / sid
        assert outputs.is_dir()
        deadline = time.monotonic() + 30  # 2 s idle, a reaper every 0.5 s, then its close
        while outputs.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not outputs.exists()
