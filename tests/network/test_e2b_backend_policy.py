"""The e2b backend holds only what E2B's own switch can: all or nothing. A policy with deny
rules (the session's, or the operator's ceiling's) has no proxy of ours to enforce it there."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.orchestrator.service.conftest import Server, make_server


@pytest.fixture(scope="module")
def with_e2b() -> Iterator[Server]:
    # No E2B key: nothing here may reach E2B's cloud; a create that gets past the service's
    # checks stops at the backend's "no API key".
    server = make_server(
        backends="local,e2b",
        default_backend="local",
        network_ceiling='{"mode": "any", "deny": ["blocked.test:*"]}',
    )
    server.env.pop("E2B_API_KEY", None)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


@pytest.mark.parametrize(
    "network",
    ["any", {"mode": "any", "deny": ["evil.test"]}],
    ids=["ceiling-deny-rules", "session-deny-rules"],
)
def test_deny_rules_are_refused_on_the_e2b_backend_not_dropped(
    with_e2b: Server, network: object
) -> None:
    """Today the service lets `any` through to the e2b backend, which turns it into E2B's
    allow_internet_access=True: the deny rules (here the ceiling's `blocked.test`, or the
    session's own `evil.test`) silently stop applying."""
    with with_e2b.client() as api:
        created = api.post("/v1/sessions", json={"backend": "e2b", "network": network})
        assert created.status_code == 400, created.text
        assert "deny" in created.text, created.text
