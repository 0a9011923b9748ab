"""A sandbox against the service that runs it, end to end: a name the operator let reach
private addresses, pointing at 127.0.0.1 and even named with the service's own port, still
does not lead through the proxy to the service's API or console (plain HTTP or CONNECT), and
reaches no loopback port but those named with it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.network.conftest import FETCH, Net
from tests.network.test_session_egress import fetched, run
from tests.orchestrator.service.conftest import service_backends


@pytest.fixture(params=service_backends())
def session(
    request: pytest.FixtureRequest, net: Net, host_listener: int
) -> Iterator[tuple[httpx.Client, str]]:
    own = net.server.url.rsplit(":", 1)[1]
    policy = [f"service.test:{own}", f"service.test:{host_listener}"]
    policy += [f"allowed.test:{host_listener}", f"allowed.test:{net.up.port}"]
    with net.server.client() as api:
        created = api.post("/v1/sessions", json={"backend": request.param, "network": policy})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        assert run(api, sid, FETCH) == ""
        yield api, sid
        api.delete(f"/v1/sessions/{sid}")


def test_a_private_host_pointing_at_the_service_does_not_reach_it(
    net: Net, session: tuple[httpx.Client, str]
) -> None:
    api, sid = session
    own = net.server.url.rsplit(":", 1)[1]
    for path in ("/v1/sessions", "/console/login", "/healthz"):
        status, text = fetched(api, sid, f"http://service.test:{own}{path}")
        assert status == 403, (path, status, text)
        assert "the service's own API, which no sandbox may reach" in text, text
    # Through a tunnel, as curl -p (and every HTTPS client) asks for it.
    argv = ["curl", "-sS", "-p", "-o", "/dev/null", "-w", "%{http_connect}"]
    result = api.post(
        f"/v1/sessions/{sid}/commands", json={"argv": [*argv, f"http://service.test:{own}/"]}
    ).json()
    assert result["exit_code"] != 0 and result["stdout"] == "403", result
    report = api.get(f"/v1/sessions/{sid}/network").json()
    to_service = [c for c in report["connections"] if c["host"] == "service.test"]
    assert len(to_service) == 4 and not any(c["allowed"] or c["address"] for c in to_service)


def test_a_private_host_reaches_only_the_port_named_with_it(
    net: Net, session: tuple[httpx.Client, str], host_listener: int
) -> None:
    """The policy allows the listener's port; the operator named only the upstream's."""
    api, sid = session
    for name in ("allowed.test", "service.test"):
        status, text = fetched(api, sid, f"http://{name}:{host_listener}/")
        assert status == 403 and "a loopback address" in text, text
        assert "only, not" in text and f"may add {name}:{host_listener}" in text, text
    assert fetched(api, sid, f"{net.allowed}/hello")[0] == 200
