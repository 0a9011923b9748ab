"""Pause, resume, snapshots and restarts through a real service, on each backend.

A DataFrame of a million rows, a fitted model, a function and a class defined in cells, and a
file survive a pause and resume, a snapshot fork, and a SIGKILL of the service followed by a
restart; a paused session holds no process; what could not be saved is named; another key can
neither resume nor fork; quotas hold; retention leaves nothing behind.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.orchestrator.persistence.state_code import BUILD, CHECK, CHECKED
from tests.orchestrator.service.conftest import (
    KEY_B,
    Server,
    leftovers,
    make_server,
    service_backends,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = make_server(max_paused_sessions_per_key=3).start()
    yield srv
    srv.stop()
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def start(api: httpx.Client, backend: str, **fields: object) -> str:
    created = api.post("/v1/sessions", json={"backend": backend, **fields})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def run(api: httpx.Client, sid: str, code: str) -> dict[str, object]:
    done = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 300})
    assert done.status_code == 200, done.text
    body: dict[str, object] = done.json()
    assert body["status"] == "ok", body
    return body


def held(server: Server, sid: str) -> list[str]:
    """The sandboxes (directories, containers) the server holds: none for a paused session."""
    return leftovers(server)


@pytest.mark.parametrize("backend", service_backends())
def test_a_paused_session_holds_nothing_and_resumes_whole(server: Server, backend: str) -> None:
    with server.client() as api:
        sid = start(api, backend)
        run(api, sid, BUILD)
        paused = api.post(f"/v1/sessions/{sid}/pause")
        assert paused.status_code == 200, paused.text
        assert paused.json()["state"] == "paused"
        assert held(server, sid) == [], "a paused session still holds a sandbox"
        listed = api.get("/v1/sessions", params={"state": "paused"}).json()
        assert [s["id"] for s in listed] == [sid]
        assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"  # looking: no wake
        assert held(server, sid) == []
        # Another key can neither see nor wake it.
        with server.client(KEY_B) as other:
            assert other.post(f"/v1/sessions/{sid}/resume").status_code == 404
            assert other.post(f"/v1/sessions/{sid}/execute", json={"code": "1"}).status_code == 404
        # The next call wakes it: everything is back, and the generator is named as lost.
        checked = run(api, sid, CHECK)
        assert str(checked["stdout"]).split() == CHECKED
        assert "gen (" in str(checked["notice"]) and "generator" in str(checked["notice"])
        assert api.get(f"/v1/sessions/{sid}").json()["state"] == "running"
        assert run(api, sid, "print(1)")["notice"] is None  # said once
        api.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("backend", service_backends())
def test_a_snapshot_forks_sessions_for_its_key_only(server: Server, backend: str) -> None:
    with server.client() as api:
        sid = start(api, backend)
        run(api, sid, BUILD)
        taken = api.post(f"/v1/sessions/{sid}/snapshots", json={"name": "prepared"})
        assert taken.status_code == 201, taken.text
        snap = taken.json()
        assert snap["name"] == "prepared" and snap["not_saved"].keys() == {"gen"}
        api.delete(f"/v1/sessions/{sid}")  # the snapshot outlives the session it came from
        forks = [start(api, backend, snapshot_id=snap["id"]) for _ in range(2)]
        for fork in forks:
            assert str(run(api, fork, CHECK)["stdout"]).split() == CHECKED
        run(api, forks[0], "df.drop(df.index, inplace=True)")  # forks share nothing
        assert "1000000" in str(run(api, forks[1], "print(len(df))")["stdout"])
        with server.client(KEY_B) as other:
            refused = other.post("/v1/sessions", json={"snapshot_id": snap["id"]})
            assert refused.status_code == 404, refused.text
            assert other.get("/v1/snapshots").json() == []
            assert other.delete(f"/v1/snapshots/{snap['id']}").status_code == 404
        assert [s["id"] for s in api.get("/v1/snapshots").json()] == [snap["id"]]
        for fork in forks:
            api.delete(f"/v1/sessions/{fork}")
        assert api.delete(f"/v1/snapshots/{snap['id']}").status_code == 204
        assert api.post("/v1/sessions", json={"snapshot_id": snap["id"]}).status_code == 404
        assert not (server.state_dir / "snapshots" / snap["id"]).exists()


@pytest.mark.parametrize("backend", service_backends())
def test_a_killed_service_comes_back_with_its_sessions(backend: str) -> None:
    srv = make_server().start()
    try:
        with srv.client() as api:
            kept = start(api, backend)  # snapshotted, then changed: variables from the snapshot
            run(api, kept, BUILD)
            assert api.post(f"/v1/sessions/{kept}/snapshots", json={}).status_code == 201
            run(api, kept, "late = 1; open('late.txt', 'w').write('x')")
            bare = start(api, backend)  # never snapshotted: files only, and said so
            run(api, bare, "v = 5; open('f.txt', 'w').write('file')")
            paused = start(api, backend)
            run(api, paused, BUILD)
            assert api.post(f"/v1/sessions/{paused}/pause").status_code == 200
        srv.stop(signal.SIGKILL)
        srv.start()
        with srv.client() as api:
            states = {s["id"]: s["state"] for s in api.get("/v1/sessions").json()}
            assert states == {kept: "paused", bare: "paused", paused: "paused"}
            assert str(run(api, paused, CHECK)["stdout"]).split() == CHECKED
            back = run(api, kept, CHECK + "import os; print(os.path.exists('late.txt'))")
            assert str(back["stdout"]).split() == [*CHECKED, "True"]
            assert "snapshot" in str(back["notice"])
            assert "late" not in str(run(api, kept, "print(sorted(globals()))")["stdout"])
            lost = run(api, bare, "print(open('f.txt').read(), 'v' in globals())")
            assert str(lost["stdout"]).split() == ["file", "False"]
            assert lost["state_lost"] is True and "restarted" in str(lost["notice"])
            for sid in (kept, bare, paused):
                assert api.delete(f"/v1/sessions/{sid}").status_code == 204
            for snap in api.get("/v1/snapshots").json():
                api.delete(f"/v1/snapshots/{snap['id']}")
        assert leftovers(srv) == []
        assert list((srv.state_dir / "snapshots").iterdir()) == []
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_idle_sessions_pause_and_retention_deletes_them_whole() -> None:
    backend = service_backends()[0]
    srv = make_server(idle_timeout_s=2, reap_interval_s=0.5, paused_retention_s=6).start()
    try:
        with srv.client() as api:
            sid = start(api, backend)
            run(api, sid, "x = 41")
            deadline = time.monotonic() + 60
            while api.get(f"/v1/sessions/{sid}").json()["state"] != "paused":
                assert time.monotonic() < deadline, "the idle session was not paused"
                time.sleep(0.5)
            assert leftovers(srv) == []
            assert "42" in str(run(api, sid, "print(x + 1)")["stdout"])
            deadline = time.monotonic() + 60
            while api.get(f"/v1/sessions/{sid}").status_code != 410:
                assert time.monotonic() < deadline, "retention did not delete the session"
                time.sleep(0.5)
            assert "paused" in api.get(f"/v1/sessions/{sid}").json()["error"]["message"]
        assert leftovers(srv) == []
        assert list((srv.state_dir / "snapshots").iterdir()) == []
        assert not (srv.state_dir / "outputs" / sid).exists()
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_the_tool_called_on_a_paused_session_just_works(server: Server) -> None:
    with server.client() as api:
        sid = start(api, service_backends()[0])
        run(api, sid, "answer = 41; gen = (i for i in range(2))")
        assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
        tool = api.post(
            "/v1/tools/code_interpreter/invoke",
            json={"arguments": {"code": "answer + 1", "session_id": sid}, "call_id": "c1"},
        ).json()
        assert tool["status"] == "ok", tool
        content = tool["output"]["content"]
        assert "42" in content and "resumed" in content and "gen (" in content
        api.delete(f"/v1/sessions/{sid}")


def test_pausing_a_busy_session_is_refused_and_loses_nothing(server: Server) -> None:
    import threading

    with server.client() as api:
        sid = start(api, service_backends()[0])
        run(api, sid, "kept = 7")

        def slow() -> None:
            with server.client() as own:
                own.post(f"/v1/sessions/{sid}/execute", json={"code": "import time; time.sleep(4)"})

        busy = threading.Thread(target=slow)
        busy.start()
        time.sleep(1.5)
        refused = api.post(f"/v1/sessions/{sid}/pause")
        busy.join()
        assert refused.status_code == 409 and "running code" in refused.text
        assert "7" in str(run(api, sid, "print(kept)")["stdout"])
        api.delete(f"/v1/sessions/{sid}")


def test_quotas_on_snapshots_hold() -> None:
    backend = service_backends()[0]
    srv = make_server(max_snapshots_per_key=1, max_saved_bytes_per_key=3 << 20).start()
    try:
        with srv.client() as api:
            sid = start(api, backend)
            run(api, sid, "small = list(range(10))")
            assert api.post(f"/v1/sessions/{sid}/snapshots", json={}).status_code == 201
            second = api.post(f"/v1/sessions/{sid}/snapshots", json={})
            assert second.status_code == 429 and "maximum of 1 snapshots" in second.text
            # Bytes: a 4 MB variable does not fit in what is left of 3 MB: named, not kept.
            run(api, sid, "big = bytes(4 << 20)")
            paused = api.post(f"/v1/sessions/{sid}/pause")
            assert paused.status_code == 200, paused.text
            back = run(api, sid, "print('big' in globals(), small[-1])")
            assert str(back["stdout"]).split() == ["False", "9"]
            assert "big (" in str(back["notice"]) and "limit" in str(back["notice"])
            api.delete(f"/v1/sessions/{sid}")
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_a_session_resumed_under_a_lower_ceiling_gets_no_more_network() -> None:
    backend = service_backends()[0]
    srv = make_server(network_ceiling="pypi.org")
    srv.start()
    try:
        with srv.client() as api:
            sid = start(api, backend, network=["pypi.org"])
            run(api, sid, "kept = 3")
            assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
        srv.stop()
        srv.env["CODE_INTERPRETER_NETWORK_CEILING"] = "none"
        srv.start()
        with srv.client() as api:
            back = run(api, sid, "import os; print(kept, os.environ.get('HTTPS_PROXY'))")
            assert str(back["stdout"]).split() == ["3", "None"]
            assert "network is now none" in str(back["notice"])
            assert api.get(f"/v1/sessions/{sid}").json()["network"]["mode"] == "none"
            api.delete(f"/v1/sessions/{sid}")
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.mark.skipif("docker" not in service_backends(), reason="images are Docker's")
def test_a_fork_starts_on_its_snapshots_image() -> None:
    from sandbox.image_labels import FULL_IMAGE

    srv = make_server(docker_images=f"code-interpreter-kernel:latest,{FULL_IMAGE}")
    srv.start()
    try:
        with srv.client() as api:
            sid = start(api, "docker", image=FULL_IMAGE)
            run(api, sid, "import plotly.graph_objects as go; fig = go.Figure()")
            snap = api.post(f"/v1/sessions/{sid}/snapshots", json={}).json()
            api.delete(f"/v1/sessions/{sid}")
            fork = start(api, "docker", snapshot_id=snap["id"])
            done = run(api, fork, "print(type(fig).__name__)")
            assert str(done["stdout"]).strip() == "Figure", done
            api.delete(f"/v1/sessions/{fork}")
            api.delete(f"/v1/snapshots/{snap['id']}")
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)
