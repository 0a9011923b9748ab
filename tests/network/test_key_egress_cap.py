"""One key against the egress budget, end to end: its sessions together hold at most the key's
cap of connections through their proxies, so another key's sandbox still gets through, and the
503 says whose cap was reached."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.network.upstream import Upstream, upstream
from tests.orchestrator.service.conftest import (
    KEY_B,
    Server,
    leftovers,
    make_server,
    service_backends,
)

PER_SESSION, PER_KEY = 3, 4
# Tunnels held open in the sandbox (to the upstream, which then waits for a request).
TUNNELS = """
import socket
_tunnels = []
def tunnel(authority):
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(f"CONNECT {authority} HTTP/1.1\\r\\nHost: {authority}\\r\\n\\r\\n".encode())
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        chunk = s.recv(65536)
        if not chunk:
            break
        head += chunk
    _tunnels.append(s)
    return head.split(b"\\r\\n")[0].decode(errors="replace")
"""


@pytest.fixture(scope="module")
def capped() -> Iterator[tuple[Server, Upstream]]:
    with upstream() as up:
        server = make_server(
            network_ceiling="any",
            egress_resolve="allowed.test=127.0.0.1",
            egress_private_hosts=f"allowed.test:{up.port}",
            egress_max_connections_per_session=PER_SESSION,
            egress_max_connections_per_key=PER_KEY,
        )
        server.start()
        try:
            yield server, up
        finally:
            server.stop()
            assert leftovers(server) == []
            shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def session(api: httpx.Client, backend: str) -> str:
    created = api.post("/v1/sessions", json={"backend": backend, "network": "any"})
    assert created.status_code == 201, created.text
    sid: str = created.json()["id"]
    ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": TUNNELS})
    assert ran.status_code == 200 and ran.json()["error"] is None, ran.text
    return sid


def tunnels(api: httpx.Client, sid: str, authority: str, count: int) -> list[str]:
    """The status line of each of `count` new tunnels, opened one after another and held."""
    code = f"import json; print(json.dumps([tunnel({authority!r}) for _ in range({count})]))"
    ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": code, "timeout_s": 60})
    assert ran.status_code == 200 and ran.json()["error"] is None, ran.text
    lines: list[str] = json.loads(ran.json()["stdout"])
    return lines


@pytest.mark.parametrize("backend", service_backends())
def test_one_keys_sessions_cannot_hold_another_keys_share(
    capped: tuple[Server, Upstream], backend: str
) -> None:
    server, up = capped
    authority = f"allowed.test:{up.port}"
    with server.client() as api, server.client(KEY_B) as other_api:
        first, second = session(api, backend), session(api, backend)
        other = session(other_api, backend)
        try:
            assert (
                tunnels(api, first, authority, PER_SESSION)
                == ["HTTP/1.1 200 Connection established"] * PER_SESSION
            )
            # The key's fourth connection fits; its fifth, in another session, does not.
            opened, refused = tunnels(api, second, authority, 2)
            assert opened == "HTTP/1.1 200 Connection established"
            assert refused.startswith("HTTP/1.1 503 too many connections: this API key's "), refused
            assert f"{PER_KEY} connections" in refused and "the key's cap" in refused, refused
            # Another key's sandbox still gets through.
            assert tunnels(other_api, other, authority, 1) == [
                "HTTP/1.1 200 Connection established"
            ]
            # One of the key's tunnels closed, once the proxy has seen it end, there is room.
            code = "_tunnels.pop(0).close()"
            assert api.post(f"/v1/sessions/{first}/execute", json={"code": code}).status_code == 200
            deadline = time.monotonic() + 30
            while not any(  # the ledger holds connections that have ended
                c["allowed"] for c in api.get(f"/v1/sessions/{first}/network").json()["connections"]
            ):
                assert time.monotonic() < deadline, "the closed tunnel never ended in the proxy"
                time.sleep(0.05)
            assert tunnels(api, second, authority, 1) == ["HTTP/1.1 200 Connection established"]
        finally:
            for client, sid in ((api, first), (api, second), (other_api, other)):
                client.delete(f"/v1/sessions/{sid}")
