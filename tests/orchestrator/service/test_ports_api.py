"""Inbound ports against a real server (docs/ports.md): a server the session's code starts is
reached by path and by host, over HTTP and WebSocket, by its owner's key, its port token, or
anyone where public; the service's credentials never reach it; refusals say why; every
connection is in the audit log."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from code_interpreter_client.http_client import Client
from tests.orchestrator.service.conftest import KEY_A, KEY_B, Server, service_backends

# In the kernel: an HTTP server on 8000 serving the workspace, whose /echo answers with what
# it was sent (headers, path, body), and a WebSocket echo on 8001 (tornado, in every image).
SERVERS = r"""
import asyncio, http.server, json, threading
import tornado.web, tornado.websocket

class Handler(http.server.SimpleHTTPRequestHandler):
    def _echo(self):
        size = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(size) if size else b""
        answer = json.dumps({"path": self.path, "method": self.command,
                             "headers": dict(self.headers.items()), "body_bytes": len(body),
                             "body_sum": sum(body) % 1000003}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("set-cookie", "app=1; Path=/")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
    def do_GET(self):
        if self.path.startswith("/echo"):
            return self._echo()
        return super().do_GET()
    do_POST = do_PUT = _echo
    def log_message(self, *args):
        pass

http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Handler)
threading.Thread(target=http_server.serve_forever, daemon=True).start()

class Echo(tornado.websocket.WebSocketHandler):
    def select_subprotocol(self, subprotocols):
        return subprotocols[0] if subprotocols else None
    def on_message(self, message):
        self.write_message(message, binary=isinstance(message, bytes))

class Greeter(tornado.websocket.WebSocketHandler):
    def open(self):
        self.write_message("hello first")
    def on_message(self, message):
        self.write_message(message)

ready = threading.Event()
def _ws():
    async def main():
        tornado.web.Application([(r"/ws", Echo), (r"/greet", Greeter)]).listen(
            8001, address="127.0.0.1")
        ready.set()
        await asyncio.Event().wait()
    asyncio.run(main())
threading.Thread(target=_ws, daemon=True).start()
assert ready.wait(60)
"""


def _create(api: httpx.Client, backend: str, ports: dict[str, Any] | None) -> str:
    body: dict[str, Any] = {"backend": backend}
    if ports is not None:
        body["ports"] = ports
    created = api.post("/v1/sessions", json=body)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def _start_servers(api: httpx.Client, sid: str) -> None:
    ran = api.post(f"/v1/sessions/{sid}/execute", json={"code": SERVERS})
    assert ran.status_code == 200 and ran.json()["status"] == "ok", ran.text
    _upload(api, sid, "listed-here.txt", b"hello")


def _upload(api: httpx.Client, sid: str, path: str, data: bytes) -> None:
    wrote = api.post(f"/v1/sessions/{sid}/files", files={"file": (path, data)})
    assert wrote.status_code == 201, wrote.text


@pytest.fixture(params=service_backends())
def serving(request: pytest.FixtureRequest, api: httpx.Client) -> Iterator[tuple[str, str]]:
    """(session id, port token) of a session with ports whose servers run."""
    sid = _create(api, request.param, {})
    try:
        _start_servers(api, sid)
        token = api.get(f"/v1/sessions/{sid}").json()["ports"]["token"]
        yield sid, token
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_a_server_in_the_session_is_reached_by_key_token_and_host(
    server: Server, serving: tuple[str, str]
) -> None:
    sid, token = serving
    with httpx.Client(base_url=server.url, timeout=60) as web:
        path = f"/v1/sessions/{sid}/ports/8000"
        listing = web.get(path + "/", headers={"X-API-Key": KEY_A})
        assert listing.status_code == 200, listing.text
        assert "listed-here.txt" in listing.text
        # Without the slash, to it (relative links need it); the file itself.
        moved = web.get(path, headers={"X-API-Key": KEY_A})
        assert moved.status_code == 307 and moved.headers["location"] == path + "/"
        got = web.get(path + "/listed-here.txt", headers={"X-Port-Token": token})
        assert got.status_code == 200 and got.content == b"hello"
        head = web.head(path + "/listed-here.txt", headers={"X-Port-Token": token})
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == "5"
        e2b_header = web.get(path + "/listed-here.txt", headers={"E2B-Traffic-Access-Token": token})
        assert e2b_header.status_code == 200
        # The host form: E2B's `<port>-<id>.<domain>`, whatever the domain here.
        host = f"8000-{sid}.localhost:{server.url.rsplit(':', 1)[1]}"
        by_host = web.get("/listed-here.txt", headers={"Host": host, "X-Port-Token": token})
        assert by_host.status_code == 200 and by_host.content == b"hello"


def test_the_services_credentials_never_reach_the_server(
    server: Server, serving: tuple[str, str]
) -> None:
    sid, token = serving
    with httpx.Client(base_url=server.url, timeout=60) as web:
        echoed = web.get(
            f"/v1/sessions/{sid}/ports/8000/echo/a%2Fb?x=1&y=%20",
            headers={
                "X-API-Key": KEY_A,
                "X-Port-Token": token,
                "E2B-Traffic-Access-Token": token,
                "Authorization": "Bearer the-apps-own",
                "X-Custom": "kept",
            },
        )
        # The host form is the app's own origin: its Authorization goes on; ours never.
        port = server.url.rsplit(":", 1)[1]
        by_host = web.get(
            "/echo",
            headers={
                "Host": f"8000-{sid}.localhost:{port}",
                "X-Port-Token": token,
                "Authorization": "Bearer the-apps-own",
                "X-Forwarded-For": "1.2.3.4",
            },
        )
        # A path the client spells oddly is still cut by segments.
        odd = web.get(f"/v1/sessions/{sid}/ports/08000/echo", headers={"X-API-Key": KEY_A})
    assert echoed.status_code == 200, echoed.text
    seen = {k.lower(): v for k, v in echoed.json()["headers"].items()}
    assert echoed.json()["path"] == "/echo/a%2Fb?x=1&y=%20"  # as the client spelt it
    assert "x-api-key" not in seen and "x-port-token" not in seen
    assert "e2b-traffic-access-token" not in seen
    assert "authorization" not in seen  # on the path form, our API's header: never passed on
    assert seen["x-custom"] == "kept"
    assert seen["x-forwarded-prefix"] == f"/v1/sessions/{sid}/ports/8000"
    assert KEY_A not in json.dumps(echoed.json()) and token not in json.dumps(echoed.json())
    # The path form serves pages on the service's origin: sandboxed there, and no cookies.
    assert "set-cookie" not in echoed.headers
    assert echoed.headers["content-security-policy"].startswith("sandbox")
    assert len(echoed.headers.get_list("server")) == 1
    host_seen = {k.lower(): v for k, v in by_host.json()["headers"].items()}
    assert host_seen["authorization"] == "Bearer the-apps-own"  # the app's own logins
    # Said once, as the service sees the client (here the test, on loopback, is a proxy the
    # service trusts, forwarded_allow_ips): not the claim passed on beside the service's own.
    assert host_seen["x-forwarded-for"] == "1.2.3.4"
    assert by_host.headers["set-cookie"] == "app=1; Path=/"
    assert "content-security-policy" not in by_host.headers
    assert odd.status_code == 200 and odd.json()["path"] == "/echo", odd.text


def test_bodies_stream_both_ways(server: Server, serving: tuple[str, str]) -> None:
    sid, _ = serving
    body = os.urandom(3 << 20)
    with httpx.Client(base_url=server.url, timeout=120, headers={"X-API-Key": KEY_A}) as web:
        sent = web.post(f"/v1/sessions/{sid}/ports/8000/echo", content=body)
        assert sent.status_code == 200, sent.text
        assert sent.json()["body_bytes"] == len(body)
        assert sent.json()["body_sum"] == sum(body) % 1000003
        big = os.urandom(2 << 20)
        with server.client() as api:
            _upload(api, sid, "big.bin", big)
        with web.stream("GET", f"/v1/sessions/{sid}/ports/8000/big.bin") as streamed:
            assert streamed.status_code == 200
            assert b"".join(streamed.iter_bytes()) == big


def test_a_websocket_is_carried_both_ways(server: Server, serving: tuple[str, str]) -> None:
    sid, token = serving
    ws_url = server.url.replace("http://", "ws://") + f"/v1/sessions/{sid}/ports/8001/ws"
    with connect(ws_url, additional_headers={"X-Port-Token": token}, subprotocols=["chat"]) as ws:
        assert ws.subprotocol == "chat"
        ws.send("hello")
        assert ws.recv(timeout=30) == "hello"
        payload = os.urandom(300_000)
        ws.send(payload)
        assert ws.recv(timeout=30) == payload
    # By host, as E2B's SDK users open it.
    port = server.url.rsplit(":", 1)[1]
    with connect(
        f"ws://8001-{sid}.localhost:{port}/ws",
        sock=socket.create_connection(("127.0.0.1", int(port))),
        additional_headers={"X-Port-Token": token},
    ) as ws:
        ws.send(b"bytes")
        assert ws.recv(timeout=30) == b"bytes"
    # A server that speaks first: its greeting is the first message, never lost.
    for _ in range(5):
        with connect(
            ws_url.replace("/ws", "/greet"), additional_headers={"X-Port-Token": token}
        ) as ws:
            assert ws.recv(timeout=30) == "hello first"
    with pytest.raises(InvalidStatus) as refused, connect(ws_url):
        pass
    assert refused.value.response.status_code == 401


def test_refusals_say_why(server: Server, api: httpx.Client, serving: tuple[str, str]) -> None:
    sid, _ = serving
    with httpx.Client(base_url=server.url, timeout=60) as web:
        nobody = web.get(f"/v1/sessions/{sid}/ports/8000/")
        assert nobody.status_code == 401, nobody.text
        assert "X-API-Key" in nobody.json()["error"]["message"]
        wrong = web.get(f"/v1/sessions/{sid}/ports/8000/", headers={"X-Port-Token": "nope"})
        assert wrong.status_code == 401 and "not this session's port token" in wrong.text
        other_key = web.get(f"/v1/sessions/{sid}/ports/8000/", headers={"X-API-Key": KEY_B})
        assert other_key.status_code == 401
        # On the path form (our API's URL space) the key may come as our API takes it.
        bearer = web.get(
            f"/v1/sessions/{sid}/ports/8000/", headers={"Authorization": f"Bearer {KEY_A}"}
        )
        assert bearer.status_code == 200, bearer.text
        bad_key = web.get(f"/v1/sessions/{sid}/ports/8000/", headers={"X-API-Key": "wrong"})
        assert bad_key.status_code == 401
        nothing = web.get(f"/v1/sessions/{sid}/ports/8799/", headers={"X-API-Key": KEY_A})
        assert nothing.status_code == 502, nothing.text
        assert nothing.json()["error"]["type"] == "PortUnreachable"
        assert "nothing answers on port 8799" in nothing.json()["error"]["message"]
        missing = web.get("/v1/sessions/nosuch/ports/8000/", headers={"X-API-Key": KEY_A})
        assert missing.status_code == 404
    plain = _create(api, service_backends()[0], None)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as web:
            owner = web.get(f"/v1/sessions/{plain}/ports/8000/", headers={"X-API-Key": KEY_A})
            assert owner.status_code == 403 and "created without ports" in owner.text
            other = web.get(f"/v1/sessions/{plain}/ports/8000/", headers={"X-API-Key": KEY_B})
            assert other.status_code == 404
        assert api.get(f"/v1/sessions/{plain}").json()["ports"] is None
    finally:
        api.delete(f"/v1/sessions/{plain}")


def test_a_public_session_is_reached_by_anyone_and_every_connection_is_logged(
    server: Server, api: httpx.Client
) -> None:
    backend = service_backends()[0]
    sid = _create(api, backend, {"public": True})
    try:
        _start_servers(api, sid)
        info = api.get(f"/v1/sessions/{sid}").json()["ports"]
        assert info["public"] is True and info["path"] == f"/v1/sessions/{sid}/ports/{{port}}/"
        with httpx.Client(base_url=server.url, timeout=60) as web:
            anyone = web.get(f"/v1/sessions/{sid}/ports/8000/listed-here.txt")
            assert anyone.status_code == 200 and anyone.content == b"hello"
            web.get(f"/v1/sessions/{sid}/ports/8799/")
        deadline = time.monotonic() + 30
        while True:
            events = api.get(
                "/v1/audit", params={"session_id": sid, "kind": "port.connection"}
            ).json()["events"]
            if len(events) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        by_port = {e["details"]["port"]: e for e in events}
        assert (
            by_port[8000]["status"] == "closed" and by_port[8000]["details"]["caller"] == "public"
        )
        assert by_port[8000]["details"]["bytes_out"] > 5
        assert by_port[8799]["status"] == "refused"
        assert "nothing answers" in by_port[8799]["details"]["reason"]
    finally:
        api.delete(f"/v1/sessions/{sid}")


def test_ports_are_asked_for_as_the_operator_allows(api: httpx.Client) -> None:
    unknown = api.post("/v1/sessions", json={"ports": {"public": True, "nope": 1}})
    assert unknown.status_code == 422


def test_the_python_client_reaches_a_port(server: Server, serving: tuple[str, str]) -> None:
    sid, token = serving
    with Client(server.url, KEY_A) as client:
        assert client.port_url(sid, 8000, "/x") == f"{server.url}/v1/sessions/{sid}/ports/8000/x"
        info = client.get_session(sid)
        assert info.ports is not None and info.ports.token == token and not info.ports.public
        echoed = client.port_request(sid, 8000, "GET", "/echo")
        assert echoed.status_code == 200, echoed.text
        seen = {name.lower() for name in echoed.json()["headers"]}
        assert "authorization" not in seen and "x-api-key" not in seen
