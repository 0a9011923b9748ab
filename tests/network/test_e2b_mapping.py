"""E2B's `network.allow_out` in its documented meaning: a domain entry filters HTTP on port 80
(Host header) and TLS on port 443 (SNI) only (https://e2b.dev/docs/network/internet-access)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from e2b_code_interpreter import Sandbox

from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.service.conftest import Server, make_server, service_backends


@pytest.fixture(scope="module")
def port_limited() -> Iterator[Server]:
    """An operator whose ceiling names the host on the web ports only."""
    server = make_server(
        network_ceiling="allowed.test:80,allowed.test:443",
        egress_resolve="allowed.test=127.0.0.1",
        egress_private_hosts="allowed.test",
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


@pytest.mark.parametrize("template", service_backends())
def test_an_e2b_domain_allow_list_fits_a_ceiling_of_the_web_ports(
    monkeypatch: pytest.MonkeyPatch, port_limited: Server, template: str
) -> None:
    """A domain in allow_out opens 80 and 443 only (as in E2B), so it fits a ceiling that names
    the web ports (the port-by-port reach is in test_clients_egress.py)."""
    point_sdk_at(monkeypatch, port_limited.url)
    sbx = Sandbox.create(
        template=template, network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]}
    )
    sbx.kill()
