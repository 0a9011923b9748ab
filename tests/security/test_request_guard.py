"""Hostile request bodies and unauthenticated calls against a real server: JSON nested far deeper
than any parser should see (protobuf's JSON parser crashed the whole process on ~30,000 levels),
sent to every route family, with and without credentials. The server must refuse them, before
any parser reads the body, and stay up for everyone else."""

from __future__ import annotations

import gzip
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

DEEP = b'{"path":' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # ~60 KB
UNCLOSED = b'{"path":' + b"{" * 30_000  # never closed: a recursive parser still descends
CONNECT_METHODS = ("ListDir", "Stat", "MakeDir", "Remove")
CONNECT_ROUTES = [
    f"{prefix}/filesystem.Filesystem/{method}"
    for prefix in ("", "/e2b")
    for method in CONNECT_METHODS
] + ["/process.Process/List", "/e2b/process.Process/List"]


@dataclass
class Target:
    server: Server
    session_id: str  # a /v1 session of KEY_A that must keep working
    sandbox_id: str  # an E2B sandbox of KEY_A
    token: str

    def alive(self) -> None:
        """The process is up and the bystander session still computes."""
        assert self.server.process is not None
        assert self.server.process.poll() is None, self.server.log.read_text()[-3000:]
        with self.server.client() as api:
            r = api.post(f"/v1/sessions/{self.session_id}/execute", json={"code": "1 + 1"})
            assert r.status_code == 200 and r.json()["results"][0]["text"] == "2", r.text


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    srv = make_server().start()
    with srv.client() as api:
        sid = api.post("/v1/sessions", json={}).json()["id"]
        made = api.post("/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": KEY_A})
        assert made.status_code == 201, made.text
    yield Target(srv, sid, made.json()["sandboxID"], made.json()["envdAccessToken"])
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


def _post(srv: Server, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    headers = {"content-type": "application/json", **headers}
    return httpx.post(srv.url + path, content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("body", [DEEP, UNCLOSED], ids=["deep", "unclosed"])
@pytest.mark.parametrize("path", CONNECT_ROUTES)
def test_deep_json_on_connect_routes_never_reaches_the_parser(
    target: Target, path: str, body: bytes
) -> None:
    anonymous = _post(target.server, path, body, {})
    assert anonymous.status_code == 401, anonymous.text
    assert anonymous.json()["code"] == "unauthenticated"
    wrong = _post(
        target.server,
        path,
        body,
        {"E2b-Sandbox-Id": target.sandbox_id, "X-Access-Token": "not-the-token"},
    )
    # Like a sandbox that is gone: E2B's SDK turns "unavailable" into its TimeoutException.
    assert wrong.status_code == 503 and wrong.json()["code"] == "unavailable", wrong.text
    assert "was not found" in wrong.json()["message"]
    owner = {"E2b-Sandbox-Id": target.sandbox_id, "X-Access-Token": target.token}
    refused = _post(target.server, path, body, owner)
    assert refused.status_code == 400, refused.text
    assert refused.json()["code"] == "invalid_argument"
    assert "nested deeper than 64" in refused.json()["message"]
    target.alive()


@pytest.mark.parametrize(
    ("encoding", "content_type"),
    [
        ({"content-encoding": "gzip"}, "application/json"),
        ({"connect-content-encoding": "gzip"}, "application/connect+json"),
        ({}, "json"),  # Connect still picks its JSON codec for this
        ({}, "text/plain"),
    ],
    ids=["gzip", "connect-gzip", "bare-json", "text"],
)
def test_a_deep_body_cannot_reach_the_connect_parser_in_disguise(
    target: Target, encoding: dict[str, str], content_type: str
) -> None:
    """Compressed, or under a content type the gate might not take for JSON."""
    body = gzip.compress(DEEP) if encoding else DEEP
    owner = {"E2b-Sandbox-Id": target.sandbox_id, "X-Access-Token": target.token}
    for prefix in ("", "/e2b"):
        headers = {**owner, **encoding, "content-type": content_type}
        refused = _post(target.server, f"{prefix}/filesystem.Filesystem/ListDir", body, headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["code"] == "invalid_argument"
    target.alive()


def test_connect_routes_still_serve_their_owner(target: Target) -> None:
    owner = {"E2b-Sandbox-Id": target.sandbox_id, "X-Access-Token": target.token}
    for prefix in ("", "/e2b"):
        listed = _post(
            target.server,
            f"{prefix}/filesystem.Filesystem/ListDir",
            b'{"path": "/workspace", "depth": 1}',
            owner,
        )
        assert listed.status_code == 200 and listed.json() == {}, listed.text


REST_ROUTES = [
    ("/v1/sessions", {"Authorization": f"Bearer {KEY_A}"}),
    ("/v1/sessions/{sid}/execute", {"Authorization": f"Bearer {KEY_A}"}),
    ("/v1/sessions/{sid}/execute/stream", {"Authorization": f"Bearer {KEY_A}"}),
    ("/v1/tools/code_interpreter/invoke", {"Authorization": f"Bearer {KEY_A}"}),
    ("/mcp", {"Authorization": f"Bearer {KEY_A}", "Accept": "application/json, text/event-stream"}),
    ("/v2/sandboxes", {"X-API-Key": KEY_A}),
    ("/e2b/v2/sandboxes", {"X-API-Key": KEY_A}),
    ("/execute", {}),  # E2B's data plane: the sandbox's token, added below
    ("/e2b/contexts", {}),
]


@pytest.mark.parametrize(("route", "credentials"), REST_ROUTES, ids=[r for r, _ in REST_ROUTES])
def test_rest_mcp_and_e2b_routes_refuse_before_reading_the_body(
    target: Target, route: str, credentials: dict[str, str]
) -> None:
    path = route.format(sid=target.session_id)
    anonymous = _post(target.server, path, DEEP, {})
    assert anonymous.status_code == 401, anonymous.text
    if not credentials:
        credentials = {"E2b-Sandbox-Id": target.sandbox_id, "X-Access-Token": target.token}
    refused = _post(target.server, path, DEEP, credentials)
    assert refused.status_code == 400, refused.text
    assert "nested deeper than 64" in refused.text
    target.alive()


def test_typed_error_for_a_deep_body_on_v1(target: Target) -> None:
    with target.server.client() as api:
        r = api.post(
            f"/v1/sessions/{target.session_id}/execute",
            content=DEEP,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "JsonTooDeep"
        # Brackets inside strings are text, not nesting: code full of them runs.
        code = "s = '" + "[{" * 5000 + "'\nlen(s)"
        ok = api.post(f"/v1/sessions/{target.session_id}/execute", json={"code": code})
        assert ok.status_code == 200 and ok.json()["results"][0]["text"] == "10000", ok.text
        # A file upload is not JSON: its brackets are data.
        files = {"file": ("b.txt", b"[" * 100_000)}
        up = api.post(
            f"/v1/sessions/{target.session_id}/files", params={"path": "b.txt"}, files=files
        )
        assert up.status_code == 201, up.text
