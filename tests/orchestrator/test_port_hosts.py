"""Which hosts are a session's port (orchestrator/ports_front/host_form.py): E2B's
`<port>-<id>.<domain>`, under the operator's domain when one is set; never E2B's own ports."""

from __future__ import annotations

import pytest

from orchestrator.ports_front.host_form import PortHosts

pytestmark = pytest.mark.unit


def routed(host: str, domain: str | None) -> tuple[str, int] | None:
    hosts = PortHosts(lambda *_: None, domain=domain)  # type: ignore[arg-type]
    return hosts.route({"type": "http", "headers": [(b"host", host.encode())]})


def test_hosts_of_ports() -> None:
    assert routed("8000-s-abc.localhost:8080", None) == ("s-abc", 8000)
    assert routed("8000-s-abc.Sandboxes.Example.com", "sandboxes.example.com") == ("s-abc", 8000)
    assert routed("8000-s-abc.elsewhere.com", "sandboxes.example.com") is None
    assert routed("49983-s-abc.localhost", None) is None  # envd's: the E2B front's
    assert routed("49999-s-abc.localhost", None) is None
    assert routed("localhost:8080", None) is None
    assert routed("api.localhost", None) is None
    assert routed("x8000-s.localhost", None) is None
