"""A session that names no backend gets one its key may use: the service's default when the key's
policy allows it, else the first backend the policy lists that the service runs; refused (403,
naming the rule) only when it runs none of them. Over REST and through E2B's default template."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from e2b_code_interpreter import Sandbox

from sandbox.backends.registry import BACKENDS
from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.governance.conftest import unique_name
from tests.orchestrator.service.conftest import Server


def backends_of(server: Server) -> tuple[list[str], str]:
    """(the backends the server runs, its default one)."""
    env = server.env
    return env["CODE_INTERPRETER_BACKENDS"].split(","), env["CODE_INTERPRETER_DEFAULT_BACKEND"]


def test_no_backend_named_gets_the_first_one_the_policy_allows_that_runs(
    governed_server: Server, add_key: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    enabled, default = backends_of(governed_server)
    others = [b for b in enabled if b != default]
    if not others:
        pytest.skip(f"the server runs {default} alone: no other backend a policy could allow")
    not_run = next(b for b in BACKENDS if b not in enabled)
    # Listed first, but not run here: passed over for the next one the service runs.
    key = add_key(unique_name("fitted"), "--backends", f"{not_run},{others[0]}")
    with governed_server.client(key) as api:
        created = api.post("/v1/sessions", json={})
        assert created.status_code == 201, created.text
        assert created.json()["backend"] == others[0], created.json()
        assert api.delete(f"/v1/sessions/{created.json()['id']}").status_code == 204

        point_sdk_at(monkeypatch, governed_server.url, key)
        sandbox = Sandbox.create()  # E2B's default template: the default backend, fitted
        try:
            [listed] = api.get("/v1/sessions").json()
            assert listed["backend"] == others[0], listed
            assert sandbox.run_code("print(6 * 7)").logs.stdout == ["42\n"]
        finally:
            sandbox.kill()


def test_no_backend_named_is_refused_when_the_policy_allows_none_that_runs(
    governed_server: Server, add_key: Callable[..., str]
) -> None:
    enabled, default = backends_of(governed_server)
    not_run = [b for b in BACKENDS if b not in enabled]
    key = add_key(unique_name("nowhere"), "--backends", ",".join(not_run))
    with governed_server.client(key) as api:
        refused = api.post("/v1/sessions", json={})
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["type"] == "PolicyDenied", error
        message = error["message"]
        assert f"use the default backend, {default}" in message, message
        assert f"`backends` allows: {', '.join(not_run)}" in message, message
        assert f"none of which this service runs ({', '.join(enabled)})" in message, message
        assert api.get("/v1/sessions").json() == []
