"""Review of issue 17 (gVisor): a deployment that runs its sessions under gVisor
(`CODE_INTERPRETER_DOCKER_RUNTIME=runsc`, "for every session" in the README) must not be left
by a client that asks for runc."""

from __future__ import annotations

import shutil

from tests.gvisor.conftest import require_gvisor
from tests.orchestrator.service.conftest import leftovers, make_server


def test_a_gvisor_deployment_refuses_a_session_asking_for_runc() -> None:
    require_gvisor()
    srv = make_server(
        backends="docker", default_backend="docker", docker_runtime="runsc", pool_size=0
    )
    srv.start()
    try:
        with srv.client() as api:
            asked = api.post("/v1/sessions", json={"backend": "docker", "runtime": "runc"})
            if asked.status_code == 201:
                api.delete(f"/v1/sessions/{asked.json()['id']}")
            assert asked.status_code == 400, (
                f"a client left gVisor: {asked.status_code} {asked.json().get('runtime')!r}"
            )
    finally:
        srv.stop()
        assert leftovers(srv) == []
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)
