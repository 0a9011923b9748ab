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
    assert routed("8000-workspace.example.io", None) is None  # no session's id


def named(host: str, domain: str | None, *, header: bool = False) -> str | None:
    hosts = PortHosts(lambda *_: None, domain=domain)  # type: ignore[arg-type]
    headers = [(b"host", host.encode())] + ([(b"e2b-sandbox-id", b"given")] if header else [])
    return hosts.e2b_sandbox({"type": "http", "headers": headers})


def test_e2b_data_plane_hosts_name_their_sandbox() -> None:
    """E2B's v1 SDK names its sandbox by host alone: said as the header its front reads."""
    assert named("49983-s-abc.e2b.test:8443", None) == "s-abc"
    assert named("49999-s-abc.e2b.test:8443", "e2b.test:8443") == "s-abc"
    assert named("49983-s-abc.elsewhere", "e2b.test:8443") is None
    assert named("49983-s-abc.e2b.test", None, header=True) is None  # the header wins
    assert named("8000-s-abc.e2b.test", None) is None  # a sandbox's own port: the path form
