"""The sessions API's `runtime`: a Docker session under gVisor on request, shown in its info;
a runtime the operator does not allow, or on a backend with no choice, is a clear 400."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gvisor.conftest import GVISOR, require_gvisor
from tests.orchestrator.service.conftest import Server, leftovers, make_server


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    require_gvisor()
    srv = make_server(backends="local,docker", default_backend="docker", pool_size=1)
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def test_a_session_asks_for_gvisor_and_gets_it(api: httpx.Client) -> None:
    created = api.post("/v1/sessions", json={"backend": "docker", "runtime": GVISOR})
    assert created.status_code == 201, created.text
    info = created.json()
    try:
        assert info["runtime"] == GVISOR
        assert info["from_pool"] is False  # the pool holds the deployment's runtime
        ran = api.post(
            f"/v1/sessions/{info['id']}/execute",
            json={
                "code": "import subprocess; print(subprocess.run(['dmesg'], "
                "capture_output=True, text=True).stdout)"
            },
        )
        assert ran.status_code == 200, ran.text
        assert "Starting gVisor" in ran.json()["stdout"]
        again = api.get(f"/v1/sessions/{info['id']}").json()
        assert again["runtime"] == GVISOR
    finally:
        api.delete(f"/v1/sessions/{info['id']}")


def test_asking_for_the_deployment_runtime_is_served_from_the_pool(api: httpx.Client) -> None:
    # The pool fills in the background (after the start, after each take): once it holds its
    # sandbox, a session asking for the deployment's runtime is served from it.
    deadline = time.monotonic() + 120
    while api.get("/v1/status").json()["pools"].get("docker", 0) < 1:
        assert time.monotonic() < deadline, "the Docker pool never held a sandbox"
        time.sleep(0.2)
    created = api.post("/v1/sessions", json={"backend": "docker", "runtime": "runc"})
    assert created.status_code == 201, created.text
    info = created.json()
    try:
        assert info["runtime"] == "runc"
        assert info["from_pool"] is True  # asking for the deployment's own fits the pool
    finally:
        api.delete(f"/v1/sessions/{info['id']}")


def test_a_runtime_not_allowed_is_a_400_naming_the_allowed(api: httpx.Client) -> None:
    refused = api.post("/v1/sessions", json={"backend": "docker", "runtime": "kata"})
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "'kata'" in message and "runc" in message and GVISOR in message


def test_a_runtime_on_the_local_backend_is_a_400(api: httpx.Client) -> None:
    refused = api.post("/v1/sessions", json={"backend": "local", "runtime": GVISOR})
    assert refused.status_code == 400, refused.text
    assert "local backend has no choice of runtime" in refused.json()["error"]["message"]


def test_local_sessions_show_no_runtime(api: httpx.Client) -> None:
    created = api.post("/v1/sessions", json={"backend": "local"})
    assert created.status_code == 201, created.text
    try:
        assert created.json()["runtime"] is None
    finally:
        api.delete(f"/v1/sessions/{created.json()['id']}")
