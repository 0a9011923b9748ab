"""Slow, half-sent, idle and non-reading HTTP connections against a real server, no key needed:
a request must arrive whole in bounded time, an answer must keep being taken, and only a
stream of input authenticated as one may pause (tests/security/test_connection_caps.py: the
caps and who makes room at them)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import time
from collections.abc import Iterator

import pytest
from e2b_code_interpreter import Sandbox
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.e2b_sdk_fixtures import point_sdk_at
from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server
from tests.security.raw_sockets import (
    PARTIAL_HEAD,
    Sockets,
    closed_or_answered,
    read_answer,
    server_peers,
    server_side,
    trickle_until_closed,
    until,
    wait_closed,
)

STALL_S = 2  # the quick server's http_write_stall_timeout_s


def _stop(srv: Server) -> None:
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def quick() -> Iterator[Server]:
    """A server whose requests must come whole within 1 s, bodies at 1,000 bytes a second,
    and whose clients must take some of their answers every 2 s."""
    srv = make_server(
        http_header_timeout_s=1, http_body_min_rate=1000, http_write_stall_timeout_s=STALL_S
    ).start()
    yield srv
    _stop(srv)


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    opened = Sockets()
    yield opened
    opened.close_all()


def test_a_half_sent_request_head_is_closed(quick: Server, sockets: Sockets) -> None:
    silent = sockets.connect("127.0.0.2", quick)
    partial = sockets.connect("127.0.0.2", quick)
    partial.sendall(PARTIAL_HEAD)
    trickling = sockets.connect("127.0.0.2", quick)
    trickling.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
    told = trickle_until_closed(trickling)
    assert told is not None, "a head sent a byte at a time was never cut off"
    assert told.startswith(b"HTTP/1.1 408"), told
    assert wait_closed(silent) == b"", "a connection that sent nothing stayed open"
    answer = wait_closed(partial)
    assert answer is not None, "a half-sent head stayed open"
    assert answer.startswith(b"HTTP/1.1 408") and b"http_header_timeout_s" in answer, answer


def test_a_body_trickled_below_the_minimum_rate_is_cut(quick: Server, sockets: Sockets) -> None:
    sock = sockets.connect("127.0.0.2", quick)
    sock.sendall(
        b"POST /v1/sessions HTTP/1.1\r\nHost: localhost\r\n"
        + f"Authorization: Bearer {KEY_A}\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    told = trickle_until_closed(sock)
    assert told is not None, "a body at 5 bytes a second held its connection"
    assert told.startswith(b"HTTP/1.1 408") and b"http_body_min_rate" in told, told
    with quick.client() as api:  # a whole body at once is fine
        assert api.get("/v1/sessions").status_code == 200


def test_an_idle_keep_alive_connection_is_closed(quick: Server, sockets: Sockets) -> None:
    idle = sockets.connect("127.0.0.2", quick)
    idle.sendall(PARTIAL_HEAD + b"\r\n")
    assert read_answer(idle).startswith(b"HTTP/1.1 200")
    assert wait_closed(idle) == b"", "an idle keep-alive connection stayed open"
    # The same after one byte of a next request (uvicorn's own keep-alive timer stops there).
    started = sockets.connect("127.0.0.2", quick)
    started.sendall(PARTIAL_HEAD + b"\r\n")
    assert read_answer(started).startswith(b"HTTP/1.1 200")
    started.sendall(b"G")
    answer = wait_closed(started)
    assert answer is not None, "a keep-alive connection that began a request stayed open"
    assert answer.startswith(b"HTTP/1.1 408"), answer


@pytest.mark.parametrize(
    "path", ["/anything/process.Process/StreamInput", "/e2b/x/process.Process/StreamInput"]
)
def test_a_path_that_merely_ends_like_a_stream_keeps_the_body_rate(
    quick: Server, sockets: Sockets, path: str
) -> None:
    """Only StreamInput itself, once its sandbox token checked out, may pause: another path
    ending the same way had its body read before any key, and a byte every 119 s held the
    connection for ever."""
    sock = sockets.connect("127.0.0.2", quick)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\n".encode()
        + b"Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n{"
    )
    answer = wait_closed(sock, within=15)
    assert answer is not None, "a paused body on a path that is no stream held its connection"
    assert answer.startswith(b"HTTP/1.1 408") and b"http_body_min_rate" in answer, answer
    unkeyed = sockets.connect("127.0.0.2", quick)
    unkeyed.sendall(
        b"POST /e2b/process.Process/StreamInput HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    told = wait_closed(unkeyed, within=15)
    assert told is not None and b" 401 " in told.split(b"\r\n")[0], told


def test_a_client_that_stops_reading_is_cut(quick: Server, sockets: Sockets) -> None:
    """Requests pipelined and no answer read: the answers pile up, and once the client has
    taken none of them for http_write_stall_timeout_s the connection is cut."""
    started = time.monotonic()
    sockets.pipelining("127.0.0.3", quick)
    assert until(lambda: server_peers(quick)["127.0.0.3"] == 1, within=10)
    assert until(lambda: server_peers(quick)["127.0.0.3"] == 0, within=STALL_S + 15), (
        "a client that reads none of its answers held its connection"
    )
    assert time.monotonic() - started >= STALL_S
    with quick.client() as api:
        metrics = api.get("/metrics").text
    assert 'cir_http_connections_closed_total{why="write_stalled"}' in metrics


def test_a_slow_reader_gets_a_long_answer_whole(quick: Server, sockets: Sockets) -> None:
    """An answer far larger than the sockets' buffers, read slowly but steadily for longer
    than the head and stall deadlines: never cut (it was, once the answer was written, by the
    next request's head deadline)."""
    data = os.urandom(12 << 20)
    with quick.client() as api:
        made = api.post("/v1/sessions", json={"backend": "local"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        put = api.post(f"/v1/sessions/{sid}/files", files={"file": ("big.bin", data)})
        assert put.status_code == 201, put.text
        try:
            sock = sockets.connect("127.0.0.1", quick, receive_buffer=16384)
            sock.sendall(
                f"GET /v1/sessions/{sid}/files/big.bin HTTP/1.1\r\nHost: localhost\r\n"
                f"Authorization: Bearer {KEY_A}\r\n\r\n".encode()
            )
            got = b""
            started = time.monotonic()
            while not got.endswith(data):
                chunk = sock.recv(16384)  # at most 16 KiB each 5 ms: 12 MiB take 3.9 s or more
                if not chunk:
                    break
                got += chunk
                time.sleep(0.005)
            took = time.monotonic() - started
            assert got.endswith(data), f"{len(got)} bytes of {len(data)} in {took:.1f} s"
            assert took > STALL_S + 1, f"read in {took:.1f} s: the test proves nothing"
        finally:
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def test_a_client_that_stops_reading_a_closing_answer_is_cut(
    quick: Server, sockets: Sockets
) -> None:
    """A keyed download asked with `Connection: close` and never read: the server closes the
    connection once it has written the answer, and the answer waits unsent. It must not wait
    for ever (the connection was no longer counted, and its descriptor was never freed)."""
    with quick.client() as api:
        made = api.post("/v1/sessions", json={"backend": "local"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        try:
            put = api.post(f"/v1/sessions/{sid}/files", files={"file": ("big", bytes(12 << 20))})
            assert put.status_code == 201, put.text
            sock = sockets.connect("127.0.0.6", quick, receive_buffer=4096)
            sock.sendall(
                f"GET /v1/sessions/{sid}/files/big HTTP/1.1\r\nHost: localhost\r\n"
                f"Authorization: Bearer {KEY_A}\r\nConnection: close\r\n\r\n".encode()
            )
            assert until(lambda: server_peers(quick)["127.0.0.6"] == 1, within=10)
            assert until(lambda: server_peers(quick)["127.0.0.6"] == 0, within=STALL_S + 15), (
                "a closing connection whose client reads nothing stayed open"
            )
        finally:
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def test_a_terminal_awaiting_its_key_waits_no_longer_than_a_request_head(quick: Server) -> None:
    """A terminal socket without an Authorization header waits for a browser's first `auth`
    frame: at most http_header_timeout_s (1 s here; it was 10 s whatever the setting)."""
    url = quick.url.replace("http://", "ws://") + "/v1/sessions/nope/terminal"
    started = time.monotonic()
    with connect(url) as ws, pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    assert "within 1 s" in closed.value.rcvd.reason
    assert time.monotonic() - started < 5


def _envelope(message: dict[str, object]) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.fixture(scope="module")
def streaming() -> Iterator[Server]:
    """A server with body windows of 2 s: E2B's SDK keeps its connections alive between calls,
    and a window as short as 1 s could close one just as the SDK reuses it."""
    srv = make_server(http_header_timeout_s=2, http_body_min_rate=1000).start()
    yield srv
    _stop(srv)


def test_streamed_input_may_pause_past_the_body_window(
    streaming: Server, sockets: Sockets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's StreamInput sends input as a person types it: a pause is no slow body."""
    point_sdk_at(monkeypatch, streaming.url)
    sbx = Sandbox.create(template="local")
    try:
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sock = sockets.connect("127.0.0.1", streaming)
        sock.sendall(
            b"POST /process.Process/StreamInput HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/connect+json\r\nTransfer-Encoding: chunked\r\n"
            + f"E2b-Sandbox-Id: {sbx.sandbox_id}\r\n".encode()
            + f"X-Access-Token: {sbx._envd_access_token}\r\n\r\n".encode()
            + _chunk(_envelope({"start": {"process": {"pid": cat.pid}}}))
            + _chunk(_envelope({"data": {"input": {"stdin": "aGkK"}}}))  # "hi\n"
        )
        time.sleep(7)  # three body windows and more with nothing sent
        assert not closed_or_answered(sock), "a paused input stream was cut"
        sock.setblocking(True)
        sock.sendall(_chunk(_envelope({"data": {"input": {"stdin": "dGhlcmUK"}}})) + b"0\r\n\r\n")
        assert read_answer(sock).startswith(b"HTTP/1.1 200")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "hi\nthere\n"
    finally:
        sbx.kill()


def _masked_frame(opcode: int, payload: bytes) -> bytes:
    """A client's WebSocket frame (clients must mask), payload under 126 bytes."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


def test_a_keyed_terminal_that_stops_reading_is_cut_not_forgotten(
    quick: Server, sockets: Sockets
) -> None:
    """A keyed terminal whose client stops reading while its shell floods, then asks to close:
    the WebSocket ends with answers still unsent, and the server does not wait for ever on a
    client that takes nothing. (A WebSocket closed by its own ping timeout with answers unsent
    stays counted until the stalled write cuts it, connection_guard._release_if_gone: that
    path takes uvicorn's 40 s of pings to reach, and is not driven here.)"""
    with quick.client() as api:
        made = api.post("/v1/sessions", json={"backend": "local"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        try:
            sock = sockets.connect("127.0.4.9", quick, receive_buffer=4096)
            sock.sendall(
                f"GET /v1/sessions/{sid}/terminal HTTP/1.1\r\nHost: localhost\r\n"
                f"Authorization: Bearer {KEY_A}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
                f"{base64.b64encode(os.urandom(16)).decode()}\r\n\r\n".encode()
            )
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(1)
            assert head.startswith(b"HTTP/1.1 101"), head
            sock.sendall(_masked_frame(0x2, b"base64 /dev/urandom\n"))  # keystrokes
            assert until(lambda: _unsent_to(quick, "127.0.4.9") > 0), "no answer piled up"
            sock.sendall(_masked_frame(0x8, struct.pack("!H", 1000)))  # close, read nothing
            # Cut within the stall time (and the WebSocket's own close timeout): gone.
            assert until(lambda: server_peers(quick)["127.0.4.9"] == 0, within=30), (
                "the server still holds the connection of a client that reads nothing"
            )
        finally:
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def _unsent_to(srv: Server, client: str) -> int:
    """Bytes the server has written to `client` that its socket has not taken yet."""
    return sum(
        int(fields[1]) for fields in server_side(srv) if fields[-1].rsplit(":", 1)[0] == client
    )
