"""A wasm session through the service (docs/wasm.md): made, run and ended over REST and the
tool, its files moved through the same routes; what it cannot do is refused with the reason
(commands, a pause, a network)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.clients.test_mcp import session_of, text_of
from tests.conftest import require_backend
from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server

pytestmark = pytest.mark.timeout(180)


def _served(**settings: object) -> Iterator[Server]:
    """A service with these settings, stopped at the module's end, having left nothing."""
    require_backend("wasm")
    made = make_server(**settings).start()
    try:
        yield made
    finally:
        made.stop()
        assert leftovers(made) == []
        shutil.rmtree(made.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from _served(backends="local,wasm", default_backend="local", network_ceiling="any")


def test_a_wasm_session_runs_over_rest_and_the_tool(server: Server) -> None:
    with server.client() as api:
        created = api.post("/v1/sessions", json={"backend": "wasm"})
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        try:
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": "import sys\nn = 6"})
            assert ran.status_code == 200 and ran.json()["status"] == "ok", ran.text
            ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": "sys.platform, n * 7"})
            assert ran.json()["results"][0]["text"] == "('emscripten', 42)", ran.text
            invoked = api.post(
                "/v1/tools/code_interpreter/invoke",
                json={"arguments": {"code": "n + 1", "session_id": sid}, "call_id": "c1"},
            )
            assert "[result]\n7" in invoked.json()["output"]["content"], invoked.text
            put = api.post(f"/v1/sessions/{sid}/files", files={"file": ("in.txt", b"hello")})
            assert put.status_code in (200, 201), put.text
            read = api.post(
                f"/v1/sessions/{sid}/execute", json={"code": "open('in.txt').read().upper()"}
            )
            assert read.json()["results"][0]["text"] == "'HELLO'", read.text
            listed = api.get(f"/v1/sessions/{sid}/files").json()
            assert [f["path"] for f in listed] == ["in.txt"], listed
        finally:
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def test_what_a_wasm_session_cannot_do_is_refused_with_the_reason(server: Server) -> None:
    with server.client() as api:
        refused = api.post("/v1/sessions", json={"backend": "wasm", "network": "any"})
        assert refused.status_code == 400, refused.text
        sid = api.post("/v1/sessions", json={"backend": "wasm"}).json()["id"]
        try:
            command = api.post(f"/v1/sessions/{sid}/commands", json={"argv": ["id"]})
            assert command.status_code == 501, command.text
            assert "cannot run processes" in command.json()["error"]["message"]
            paused = api.post(f"/v1/sessions/{sid}/pause")
            assert paused.status_code == 409, paused.text
            assert paused.json()["error"]["type"] == "PauseUnsupported"
        finally:
            api.delete(f"/v1/sessions/{sid}")


@pytest.fixture(scope="module")
def wasm_server() -> Iterator[Server]:
    """A service whose default (and only) backend is wasm: what MCP's tool makes."""
    yield from _served(backends="wasm", default_backend="wasm")


async def test_a_wasm_session_through_mcp(wasm_server: Server) -> None:
    """The service's MCP front with the `mcp` package's own client: a session on the wasm
    backend keeps its state across calls."""
    server = wasm_server
    sid = ""
    try:
        async with httpx2.AsyncClient(
            headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120
        ) as http:
            transport = streamable_http_client(f"{server.url}/mcp", http_client=http)
            async with Client(transport) as client:
                made = await client.call_tool("code_interpreter", {"code": "import sys\nx = 20"})
                assert not made.is_error, made
                sid = session_of(made)
                ran = await client.call_tool(
                    "code_interpreter", {"code": "sys.platform, x * 2 + 2", "session_id": sid}
                )
                assert "[result]\n('emscripten', 42)" in text_of(ran), text_of(ran)
        with server.client() as api:
            assert api.get(f"/v1/sessions/{sid}").json()["backend"] == "wasm"
    finally:
        if sid:
            with server.client() as api:
                api.delete(f"/v1/sessions/{sid}")
