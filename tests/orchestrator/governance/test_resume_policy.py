"""A paused session wakes under its key's policy as it is now, not as it was when it was made:
limits above the policy's ceilings are lowered (and said), a backend the key may no longer use
refuses the resume (403 naming the rule) and the session stays paused, nothing lost."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from tests.orchestrator.governance.conftest import CliResult, eventually, unique_name
from tests.orchestrator.service.conftest import Server


def policy_of(api: httpx.Client) -> dict[str, object]:
    return dict(api.get("/v1/whoami").json()["policy"])


def test_a_resume_is_held_to_the_keys_policy_as_it_is_now(
    governed_server: Server, keys: Callable[..., CliResult], add_key: Callable[..., str]
) -> None:
    name = unique_name("sleeper")
    key = add_key(name)
    with governed_server.client(key) as api:
        created = api.post("/v1/sessions", json={"backend": "local", "limits": {"memory_mb": 2048}})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 41"}).is_success
            assert api.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"

            # The ceiling lowered while it slept: it wakes within it, and is told.
            assert keys("set-policy", name, "--max-limit", "memory_mb=1024").exit_code == 0
            assert eventually(lambda: policy_of(api).get("max_limits") == {"memory_mb": 1024.0})
            resumed = api.post(f"/v1/sessions/{sid}/resume")
            assert resumed.status_code == 200, resumed.text
            assert resumed.json()["session"]["limits"]["memory_mb"] == 1024
            assert "max_limits" in (resumed.json()["notice"] or ""), resumed.json()
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x + 1"}).json()
            assert ran["results"][0]["text"] == "42", ran  # its state came back with it

            # Its backend is no longer the key's: the resume is refused, the session kept.
            assert api.post(f"/v1/sessions/{sid}/pause").json()["state"] == "paused"
            assert keys("set-policy", name, "--backends", "docker").exit_code == 0
            assert eventually(lambda: policy_of(api).get("backends") == ["docker"])
            refused = api.post(f"/v1/sessions/{sid}/resume")
            assert refused.status_code == 403, refused.text
            message = refused.json()["error"]["message"]
            assert "`backends`" in message and "local" in message, message
            executed = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x"})
            assert executed.status_code == 403, executed.text  # a call that would wake it
            assert api.get(f"/v1/sessions/{sid}").json()["state"] == "paused"

            # Allowed again: it wakes with everything it had.
            assert keys("set-policy", name, "--backends", "local,docker").exit_code == 0
            assert eventually(lambda: policy_of(api).get("backends") == ["local", "docker"])
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": "x"}).json()
            assert ran["results"][0]["text"] == "41", json.dumps(ran)
        finally:
            api.delete(f"/v1/sessions/{sid}")
