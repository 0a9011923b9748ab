"""Egress across a session's life, end to end: a real server whose default policy reaches a
stand-in host on loopback (through the proxy's test resolver), warm pools, kernel restarts,
interrupts, terminals, and the session's end."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.network.conftest import FETCH, new_session
from tests.network.upstream import HELLO, Upstream, upstream
from tests.orchestrator.service.conftest import Server, leftovers, make_server, service_backends


@dataclass
class Pooled:
    server: Server
    up: Upstream

    @property
    def hello(self) -> str:
        return f"http://allowed.test:{self.up.port}/hello"


@pytest.fixture(scope="module")
def pooled() -> Iterator[Pooled]:
    with upstream() as up:
        server = make_server(
            network_ceiling="any",
            network_default=f"allowed.test:{up.port}",
            egress_resolve="allowed.test=127.0.0.1",
            egress_private_hosts=f"allowed.test:{up.port}",
            pool_size=1,
        )
        server.start()
        try:
            yield Pooled(server, up)
        finally:
            server.stop()
            assert leftovers(server) == []
            shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def run(api: httpx.Client, sid: str, code: str) -> str:
    reply = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 120})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["error"] is None, body["error"]
    return str(body["stdout"])


def fetched(api: httpx.Client, sid: str, url: str) -> tuple[int, str]:
    status, text = json.loads(run(api, sid, FETCH + f"\nprint(json.dumps(fetch({url!r})))"))
    return int(status), str(text)


def pooled_session(api: httpx.Client, backend: str) -> str:
    """A session taken from the warm pool (the pool fills in the background)."""
    deadline = time.monotonic() + 120
    while True:
        created = api.post("/v1/sessions", json={"backend": backend})
        assert created.status_code == 201, created.text
        body = created.json()
        if body["from_pool"]:
            assert body["network"]["mode"] == "allow_list", body["network"]
            return str(body["id"])
        api.delete(f"/v1/sessions/{body['id']}")
        assert time.monotonic() < deadline, "the pool never gave a sandbox"
        time.sleep(2)


@pytest.mark.parametrize("backend", service_backends())
def test_a_pooled_sandbox_reaches_the_allowed_host(pooled: Pooled, backend: str) -> None:
    with pooled.server.client() as api:
        sid = pooled_session(api, backend)
        try:
            assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())
        finally:
            api.delete(f"/v1/sessions/{sid}")


@pytest.mark.parametrize("backend", service_backends())
def test_the_proxy_survives_a_kernel_restart_and_an_interrupt(pooled: Pooled, backend: str) -> None:
    with pooled.server.client() as api, new_session(api, {"backend": backend}) as sid:
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())
        interrupted = api.post(f"/v1/sessions/{sid}/interrupt")
        assert interrupted.status_code == 200, interrupted.text
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())
        restarted = api.post(f"/v1/sessions/{sid}/restart")
        assert restarted.status_code == 200, restarted.text
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())


@pytest.mark.parametrize("backend", service_backends())
def test_sigint_to_the_kernels_process_group_leaves_the_proxy(pooled: Pooled, backend: str) -> None:
    """Ctrl-C semantics (`os.killpg(os.getpgid(0), SIGINT)`, as code stopping its own worker
    pool does) must not take the sandbox's network away. On the local backend the kernel is in
    process group 1, so killpg(1) is kill(-1): every process of the sandbox, the forwarder
    included, gets it; the forwarder shrugs such signals off."""
    with pooled.server.client() as api, new_session(api, {"backend": backend}) as sid:
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())
        reply = api.post(
            f"/v1/sessions/{sid}/execute",
            json={
                "code": "import os, signal, time\n"
                "try:\n    os.killpg(os.getpgid(0), signal.SIGINT); time.sleep(1)\n"
                "except KeyboardInterrupt:\n    pass\n",
                "timeout_s": 60,
            },
        )
        assert reply.status_code == 200, reply.text
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())


@pytest.mark.parametrize("backend", service_backends())
def test_a_terminal_and_a_command_get_the_proxy(pooled: Pooled, backend: str) -> None:
    with pooled.server.client() as api, new_session(api, {"backend": backend}) as sid:
        for terminal in (None, {"rows": 24, "cols": 80}):
            result = api.post(
                f"/v1/sessions/{sid}/commands",
                json={
                    "command": f"curl -sS {pooled.hello}",
                    "terminal": terminal,
                    "timeout_s": 60,
                },
            ).json()
            out = result.get("stdout", "") + result.get("pty", "")
            assert HELLO.decode() in json.dumps(result) or HELLO.decode() in out, result


@pytest.mark.parametrize("backend", service_backends())
def test_a_session_end_frees_its_proxy(pooled: Pooled, backend: str) -> None:
    with pooled.server.client() as api:
        created = api.post("/v1/sessions", json={"backend": backend})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())
        report = api.get(f"/v1/sessions/{sid}/network").json()
        assert report["connections_allowed"] >= 1, report
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204
        gone = api.get(f"/v1/sessions/{sid}/network")
        assert gone.status_code in (404, 410), gone.text


@pytest.mark.skipif("docker" not in service_backends(), reason="gVisor is a Docker runtime")
def test_a_session_under_gvisor_reaches_the_allowed_host(pooled: Pooled) -> None:
    """Under runsc the host sees gVisor's gofer (root) connect to a bound Unix socket, not the
    sandbox's uid: the egress channel accepts exactly that peer (GVISOR_SOCKET_PEER), as the
    host-tool channel does."""
    with (
        pooled.server.client() as api,
        new_session(api, {"backend": "docker", "runtime": "runsc"}) as sid,
    ):
        assert api.get(f"/v1/sessions/{sid}").json()["runtime"] == "runsc"
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())


def test_each_connection_is_a_line_in_the_service_log(pooled: Pooled) -> None:
    """docs/network.md: every connection, allowed or refused, is "a line in the service log",
    also when `code-interpreter serve` runs without --verbose (the root logger at WARNING)."""
    backend = service_backends()[0]
    with pooled.server.client() as api, new_session(api, {"backend": backend}) as sid:
        assert fetched(api, sid, pooled.hello) == (200, HELLO.decode())
        assert fetched(api, sid, "http://refused.test/")[0] == 403
    lines = [line for line in pooled.server.log.read_text().splitlines() if sid in line]
    assert any("allowed.test" in line and "allowed" in line for line in lines), lines
    assert any("refused.test" in line and "refused" in line for line in lines), lines
