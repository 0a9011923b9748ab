"""`code-interpreter keys revoke` on a live service: the key answers 401 at once (within the
service's second) and its sessions end, running and paused, within a reap interval; other keys'
sessions are untouched."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import closing

from tests.orchestrator.governance.conftest import KEY_B, CliResult, eventually, unique_name
from tests.orchestrator.service.conftest import Server


def sessions_of(server: Server, owner: str) -> list[tuple[str, str]]:
    """(id, state) of the owner's session records in the service's state.db."""
    with closing(sqlite3.connect(server.state_dir / "state.db", timeout=5)) as db:
        rows = db.execute("SELECT id, state FROM sessions WHERE owner = ?", (owner,)).fetchall()
    return [(str(r[0]), str(r[1])) for r in rows]


def sandboxes(server: Server) -> set[str]:
    local = server.state_dir / "local"
    return {p.name for p in local.iterdir()} if local.is_dir() else set()


def test_a_revoked_keys_calls_fail_and_its_sessions_end_running_and_paused(
    governed_server: Server,
    keys: Callable[..., CliResult],
    add_key: Callable[..., str],
) -> None:
    name = unique_name("leaver")
    key = add_key(name)
    with governed_server.client(KEY_B) as other:
        kept = other.post("/v1/sessions", json={"backend": "local"})
        assert kept.status_code == 201, kept.text
        kept_id = kept.json()["id"]
    try:
        with governed_server.client(key) as api:
            owner = api.get("/v1/whoami").json()["id"]
            before = sandboxes(governed_server)
            running = api.post("/v1/sessions", json={"backend": "local"}).json()["id"]
            paused = api.post("/v1/sessions", json={"backend": "local"}).json()["id"]
            assert api.post(f"/v1/sessions/{paused}/execute", json={"code": "y = 1"}).is_success
            assert api.post(f"/v1/sessions/{paused}/pause").status_code == 200
            assert sorted(sessions_of(governed_server, owner)) == sorted(
                [(running, "running"), (paused, "paused")]
            )
            assert len(sandboxes(governed_server) - before) == 1  # the running one's

            revoked = keys("revoke", name)
            assert revoked.exit_code == 0, revoked.stderr
            assert eventually(lambda: api.get("/v1/sessions").status_code == 401)
            assert "invalid API key" in api.get(f"/v1/sessions/{running}").text
        # Within a reap interval (0.5 s here) after the service read the revocation: both
        # records, the paused state and the running sandbox are gone.
        assert eventually(lambda: sessions_of(governed_server, owner) == [], within_s=10)
        assert eventually(lambda: not (sandboxes(governed_server) - before), within_s=10)
        shown = keys("show", name)
        assert '"state": "revoked"' in shown.stdout and '"keys": 0' in shown.stdout
        again = keys("revoke", name)
        assert again.exit_code == 0 and "revoked already" in again.stdout
        assert keys("rotate", name).exit_code == 2  # a revoked key is not brought back
        with governed_server.client(KEY_B) as other:  # another key's session runs on
            assert other.post(f"/v1/sessions/{kept_id}/execute", json={"code": "1"}).is_success
    finally:
        with governed_server.client(KEY_B) as other:
            other.delete(f"/v1/sessions/{kept_id}")
