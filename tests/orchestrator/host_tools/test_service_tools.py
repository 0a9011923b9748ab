"""Host tools through the real service (`code-interpreter serve` in a subprocess), configured
as a user would: Python callables by import path, an HTTP endpoint and an MCP server (stdio)."""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.orchestrator.service.conftest import (
    KEY_A,
    Server,
    leftovers,
    make_server,
    service_backends,
)

MCP_SERVER = str(Path(__file__).with_name("example_mcp_tool_server.py"))


@pytest.fixture(scope="module")
def rates_endpoint() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None: ...

        def do_POST(self) -> None:
            sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps({"eur": round(sent["usd"] * 0.5, 2)}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/convert"
    server.shutdown()


@pytest.fixture(scope="module")
def tool_server(rates_endpoint: str) -> Iterator[Server]:
    host_tools = {
        "python": ["tests.orchestrator.host_tools.tools_for_tests:TOOLS"],
        "http": [
            {
                "name": "usd_to_eur",
                "description": "Convert US dollars to euros.",
                "url": rates_endpoint,
                "headers": {"Authorization": "Bearer host-only-secret"},
                "parameters": {
                    "type": "object",
                    "properties": {"usd": {"type": "number"}},
                    "required": ["usd"],
                },
            }
        ],
        "mcp": [
            {"name": "test", "command": sys.executable, "args": [MCP_SERVER], "prefix": "mcp_"}
        ],
        "session_default": ["add", "mcp_shout"],
        "call_timeout_s": 5,
    }
    srv = make_server(host_tools=json.dumps(host_tools), pool_size=1)
    srv.start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def api(tool_server: Server) -> Iterator[httpx.Client]:
    with tool_server.client(KEY_A) as client:
        yield client


def execute(api: httpx.Client, sid: str, code: str) -> dict[str, object]:
    r = api.post(f"/v1/sessions/{sid}/execute", json={"code": code})
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    main = [x for x in out["results"] if x["is_main_result"]]  # type: ignore[attr-defined]
    out["text"] = main[0]["text"] if main else None
    return out


@pytest.mark.parametrize("backend", service_backends())
def test_a_session_calls_python_http_and_mcp_tools(api: httpx.Client, backend: str) -> None:
    tools = ["add", "slow", "usd_to_eur", "mcp_add", "mcp_word_count"]
    created = api.post("/v1/sessions", json={"backend": backend, "tools": tools})
    assert created.status_code == 201, created.text
    info = created.json()
    assert info["tools"] == tools and info["from_pool"] is False  # pooled ones have no channel
    sid = info["id"]
    try:
        ex = execute(
            api,
            sid,
            "import asyncio, host_tools\n"
            "await asyncio.gather(host_tools.add(1, b=2), host_tools.usd_to_eur(10),\n"
            "    host_tools.mcp_add(2, 3), host_tools.mcp_word_count('one two three'))",
        )
        assert ex["status"] == "ok", ex
        assert ex["text"] == "[3, {'eur': 5.0}, 5, {'words': 3}]"
        manifest = execute(api, sid, "open('/run/host-tools/manifest.json').read()")["text"]
        assert "host-only-secret" not in str(manifest) and "127.0.0.1" not in str(manifest)
        ex = execute(api, sid, "host_tools.sync.mcp_shout('x')")
        assert ex["status"] == "error" and "has no tool 'mcp_shout'" in str(ex["error"])
        restarted = api.post(f"/v1/sessions/{sid}/restart")
        assert restarted.status_code == 200
        assert execute(api, sid, "import host_tools; host_tools.sync.add(2)")["text"] == "4"
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_unknown_tools_are_refused(api: httpx.Client) -> None:
    r = api.post("/v1/sessions", json={"tools": ["add", "rm_rf"]})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "ToolsNotAvailable"
    assert "'rm_rf'" in r.json()["error"]["message"]


def test_a_session_without_tools_has_none(api: httpx.Client) -> None:
    created = api.post("/v1/sessions", json={})
    sid = created.json()["id"]
    try:
        assert created.json()["tools"] == []
        ex = execute(api, sid, "import host_tools")
        assert ex["status"] == "error" and "ModuleNotFoundError" in str(ex["error"])
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_the_tool_description_lists_the_callable_tools(api: httpx.Client) -> None:
    text = api.get("/v1/tools/code_interpreter?format=anthropic").json()["description"]
    assert "import host_tools" in text and "asyncio.gather" in text
    assert "- add(a, *, b=2): Add two integers." in text
    assert "- mcp_shout(text): The text in capitals." in text
    assert "slow" not in text  # not a default tool
    created = api.post("/v1/sessions", json={"tools": ["slow"]}).json()
    try:
        r = api.get(f"/v1/tools/code_interpreter?format=anthropic&session_id={created['id']}")
        text = r.json()["description"]
        assert "- slow(seconds): Sleep on the host" in text and "add(" not in text
    finally:
        api.delete(f"/v1/sessions/{created['id']}")
    plain = api.post("/v1/sessions", json={}).json()
    try:
        r = api.get(f"/v1/tools/code_interpreter?format=anthropic&session_id={plain['id']}")
        assert "host_tools" not in r.json()["description"]
    finally:
        api.delete(f"/v1/sessions/{plain['id']}")


def test_sessions_the_tool_creates_get_the_default_tools(api: httpx.Client) -> None:
    code = (
        "import host_tools\nprint(host_tools.sync.add(20, b=22), host_tools.sync.mcp_shout('hi'))"
    )
    r = api.post(
        "/v1/tools/code_interpreter/invoke",
        json={"arguments": {"code": code}, "format": "mcp"},
    )
    body = r.json()
    try:
        assert body["status"] == "ok", body
        assert "42 HI" in body["output"]["content"][0]["text"]
    finally:
        api.delete(f"/v1/sessions/{body['session_id']}")
