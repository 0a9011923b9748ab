"""E2B's `get_host(port)` through E2B's own SDK: a server started in the sandbox is reached at
the host it gives (on loopback, through the service), over HTTP and WebSocket; a sandbox
without public traffic wants its traffic access token; `mask_request_host` is the Host the
server sees."""

from __future__ import annotations

import http.client
import json
import socket
import time

from e2b_code_interpreter import Sandbox
from websockets.sync.client import connect

from tests.orchestrator.service.conftest import Server

WEBSOCKET_ECHO = """
import asyncio, threading
import tornado.web, tornado.websocket

class Echo(tornado.websocket.WebSocketHandler):
    def on_message(self, message):
        self.write_message(message, binary=isinstance(message, bytes))

ready = threading.Event()
def _serve():
    async def main():
        tornado.web.Application([(r"/ws", Echo)]).listen(8001, address="127.0.0.1")
        ready.set()
        await asyncio.Event().wait()
    asyncio.run(main())
threading.Thread(target=_serve, daemon=True).start()
assert ready.wait(60)
"""


def get(server: Server, host: str, path: str, headers: dict[str, str] | None = None) -> tuple:
    """GET `path` from the service on loopback, as a client that resolved `host` to it."""
    port = int(server.url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", path, headers={"Host": host, **(headers or {})})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def until_served(server: Server, host: str, headers: dict[str, str] | None = None) -> bytes:
    """The directory listing once the server started in the background answers."""
    deadline = time.monotonic() + 60
    while True:
        status, body = get(server, host, "/", headers)
        if status == 200 or time.monotonic() > deadline:
            assert status == 200, body
            return body
        time.sleep(0.2)


def test_get_host_reaches_a_server_the_sandbox_started(e2b_env: Server, sbx: Sandbox) -> None:
    sbx.files.write("/home/user/listed-here.txt", "hi")
    sbx.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user")
    host = sbx.get_host(8000)
    assert host == f"8000-{sbx.sandbox_id}.{e2b_env.url.removeprefix('http://')}"
    assert b"listed-here.txt" in until_served(e2b_env, host)
    # A WebSocket through the host of its port.
    assert sbx.run_code(WEBSOCKET_ECHO).error is None
    port = int(e2b_env.url.rsplit(":", 1)[1])
    with connect(
        f"ws://{sbx.get_host(8001)}/ws", sock=socket.create_connection(("127.0.0.1", port))
    ) as ws:
        ws.send("echo me")
        assert ws.recv(timeout=30) == "echo me"


def test_private_traffic_wants_the_traffic_token_and_a_mask_is_the_host_seen(
    e2b_env: Server, template: str
) -> None:
    sandbox = Sandbox.create(
        template=template,
        network={"allow_public_traffic": False, "mask_request_host": "localhost:${PORT}"},
    )
    try:
        token = sandbox.traffic_access_token
        assert token
        sandbox.run_code(
            "import http.server, json, threading\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        body = json.dumps({'host': self.headers['host']}).encode()\n"
            "        self.send_response(200); self.send_header('content-length', str(len(body)))\n"
            "        self.end_headers(); self.wfile.write(body)\n"
            "s = http.server.ThreadingHTTPServer(('127.0.0.1', 8002), H)\n"
            "threading.Thread(target=s.serve_forever, daemon=True).start()\n"
        )
        host = sandbox.get_host(8002)
        status, body = get(e2b_env, host, "/")
        assert status == 401, body
        status, body = get(e2b_env, host, "/", {"e2b-traffic-access-token": token})
        assert status == 200, body
        assert json.loads(body) == {"host": "localhost:8002"}
    finally:
        sandbox.kill()
