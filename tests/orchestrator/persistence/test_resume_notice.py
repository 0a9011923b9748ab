"""The notice a resumed session says once: it does not grow with each pause and resume."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.orchestrator.service.conftest import make_server, service_backends

pytestmark = pytest.mark.timeout(300)


def _start(api: httpx.Client, **fields: object) -> str:
    created = api.post("/v1/sessions", json={"backend": service_backends()[0], **fields})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_a_notice_not_yet_said_does_not_grow_with_each_pause_and_resume() -> None:
    """Paused and resumed again and again with no execution between (an agent listing files,
    an idle session woken by a look at it): the notice waiting to be said carried the last one
    whole inside the new one, so it grew by a copy at each round ("resumed: resumed: ...")."""
    srv = make_server().start()
    try:
        with srv.client() as api:
            sid = _start(api)
            built = api.post(
                f"/v1/sessions/{sid}/execute",
                json={"code": "x = 1; gen = (i for i in range(3))"},
            )
            assert built.status_code == 200, built.text
            notices = []
            for _ in range(4):
                assert api.post(f"/v1/sessions/{sid}/pause").status_code == 200
                resumed = api.post(f"/v1/sessions/{sid}/resume")
                assert resumed.status_code == 200, resumed.text
                notices.append(str(resumed.json()["notice"]))
            last = notices[-1]
            assert last.count("resumed") == 1, notices
            assert len(last) <= len(notices[0]) + 40, notices
            assert "gen (" in last and "1 variable(s)" in last, last
            said = api.post(f"/v1/sessions/{sid}/execute", json={"code": "print(x)"}).json()
            assert said["stdout"].strip() == "1" and said["notice"].startswith(last), said
    finally:
        srv.stop()
        shutil.rmtree(srv.state_dir.parent, ignore_errors=True)
