"""A server whose sessions may have a network, and a stand-in for the internet on loopback."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.network.upstream import Upstream, upstream
from tests.orchestrator.service.conftest import Server, leftovers, make_server

MAX_BYTES = 1 << 20
# NO_PROXY (localhost, 127.0.0.1, ::1) is cleared: the tests send loopback names to the proxy
# on purpose, to see it refuse them.
FETCH = """
import json, os, urllib.request, urllib.error
os.environ["NO_PROXY"] = os.environ["no_proxy"] = ""
def fetch(url, proxy=True):
    opener = urllib.request.build_opener() if proxy else urllib.request.build_opener(
        urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=60) as r:
            return [r.status, r.read().decode(errors="replace")]
    except urllib.error.HTTPError as e:
        return [e.code, e.read().decode(errors="replace") + " | " + str(e.reason)]
    except Exception as e:
        return [0, f"{type(e).__name__}: {e}"]
"""


@contextlib.contextmanager
def new_session(api: httpx.Client, body: dict[str, object]) -> Iterator[str]:
    """A session made with `body` (201, else the test fails), ended after."""
    created = api.post("/v1/sessions", json=body)
    assert created.status_code == 201, created.text
    sid = str(created.json()["id"])
    try:
        yield sid
    finally:
        api.delete(f"/v1/sessions/{sid}")


@dataclass
class Net:
    server: Server
    up: Upstream

    @property
    def allowed(self) -> str:
        return f"http://allowed.test:{self.up.port}"


@contextlib.contextmanager
def served_net(**settings: object) -> Iterator[Net]:
    """A server with the loopback internet below, its egress settings those of these tests
    (`settings`: more of the server's own, e.g. its backends)."""
    with upstream() as up:
        resolve = {
            "allowed.test": "127.0.0.1",
            "other.test": "127.0.0.1",
            "rebind.test": "127.0.0.1",
            "metadata.test": "169.254.169.254",
            "service.test": "127.0.0.1",
        }
        server = make_server(
            network_ceiling="any",
            egress_resolve=",".join(f"{n}={a}" for n, a in resolve.items()),
            # 127.0.0.1 too: an address rule (E2B's allow_out) reaches the upstream by address.
            # Each on the upstream's port: a private host reaches only the ports named with it.
            egress_private_hosts=",".join(
                f"{name}:{up.port}" for name in ("allowed.test", "other.test", "127.0.0.1")
            ),
            egress_max_bytes_per_session=MAX_BYTES,
            **settings,
        )
        # The operator names the service's own port with a private host, as by mistake: the
        # proxy still refuses it (test_service_unreachable.py).
        own_port = server.url.rsplit(":", 1)[1]
        server.env["CODE_INTERPRETER_EGRESS_PRIVATE_HOSTS"] += f",service.test:{own_port}"
        server.start()
        try:
            yield Net(server, up)
        finally:
            server.stop()
            assert leftovers(server) == []
            shutil.rmtree(server.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    with served_net() as served:
        yield served
