"""The E2B front's sandbox listing: a `startedAfter` time without an offset is a 400 that says
what to send, not a 500."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import pytest

from tests.orchestrator.service.conftest import KEY_A, Server, make_server

pytestmark = pytest.mark.timeout(300)
OWNER = "key-a"


@pytest.fixture(scope="module")
def e2b_server() -> Iterator[Server]:
    srv = make_server().start()
    yield srv
    srv.stop()
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def test_a_started_after_without_an_offset_is_a_bad_request_not_a_500(
    e2b_server: Server,
) -> None:
    """`startedAfter` is compared with the sandboxes' start times (which carry an offset): a
    time without one is refused with a 400 that says what to send."""
    headers = {"X-API-KEY": KEY_A}
    with httpx.Client(base_url=e2b_server.url, headers=headers, timeout=120) as api:
        made = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
        assert made.status_code == 201, made.text
        sid = made.json()["sandboxID"]
        try:
            listed = api.get("/v2/sandboxes", params={"startedAfter": "2020-01-01T00:00:00"})
            assert listed.status_code == 400, listed.text
            assert "offset" in listed.json()["message"], listed.text
            aware = api.get("/v2/sandboxes", params={"startedAfter": "2020-01-01T00:00:00Z"})
            assert aware.status_code == 200 and sid in [x["sandboxID"] for x in aware.json()]
        finally:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204
