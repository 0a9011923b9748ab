"""A sandbox against the service's file descriptors, end to end: code in the sandbox connects to
its egress socket itself (it is bound into the sandbox at /run/egress) and keeps connecting.
The service's descriptors are shared by every session and by its API, so one sandbox must not
be able to hold more of them than its connection cap allows."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.orchestrator.service.conftest import Server, leftovers, make_server, service_backends

CAP = 8
FLOOD = """
import socket, threading, time
_held = []
def _flood(stop_at):
    while time.time() < stop_at:
        while len(_held) < 800:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("/run/egress/proxy.sock")
            except OSError:
                s.close(); break
            s.setblocking(False)
            _held.append(s)
        for s in list(_held):  # reconnect those the proxy has closed
            try:
                if s.recv(65536) == b"":
                    _held.remove(s); s.close()
            except BlockingIOError:
                pass
            except OSError:
                _held.remove(s); s.close()
        time.sleep(0.05)
threading.Thread(target=_flood, args=(time.time() + 20,), daemon=True).start()
"""


@pytest.fixture(scope="module")
def capped() -> Iterator[Server]:
    server = make_server(
        network_ceiling="any",
        egress_max_connections_per_session=CAP,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
        assert leftovers(server) == []
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("backend", service_backends())
def test_a_sandbox_cannot_hold_the_services_descriptors(capped: Server, backend: str) -> None:
    assert capped.process is not None
    pid = capped.process.pid
    with capped.client() as api:
        created = api.post("/v1/sessions", json={"backend": backend, "network": "any"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            before = descriptors(pid)
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": FLOOD, "timeout_s": 60})
            assert ran.status_code == 200 and ran.json()["error"] is None, ran.text
            most = before
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                most = max(most, descriptors(pid))
                time.sleep(0.2)
            assert most - before <= 4 * CAP + 32, (
                f"one sandbox with a cap of {CAP} connections held {most - before} of the "
                f"service's descriptors ({before} before)"
            )
        finally:
            api.delete(f"/v1/sessions/{sid}")
            assert httpx.get(f"{capped.url}/healthz", timeout=30).status_code == 200
