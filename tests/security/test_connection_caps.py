"""How many connections the service holds, against a real server, no key needed: one address
holds a bounded share, all of them together a bounded total that leaves descriptors for the
service's own work, a burst of connects never runs it out of descriptors, and at the cap a
connection whose caller has not proven a key makes room, whatever it is doing, while a keyed
request being served never does (tests/security/test_slow_connections.py: the deadlines)."""

from __future__ import annotations

import base64
import errno
import os
import shutil
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.orchestrator.service.conftest import KEY_A, Server, leftovers, make_server
from tests.security.raw_sockets import (
    PARTIAL_HEAD,
    Sockets,
    accept_queue,
    all_connected,
    closed_or_answered,
    descriptors_for_the_client,
    port_of,
    server_descriptors,
    server_peers,
    until,
    wait_closed,
)

SERVER_OPEN_FILES = 2048  # the patient server's descriptor limit: the flood goes past it
FLOOD_ADDRESSES = [f"127.0.1.{i}" for i in range(1, 41)]
FLOOD_PER_ADDRESS = 55  # 2,200 connections in all, each address under its cap of 64


def _stop(srv: Server) -> None:
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def enough_descriptors() -> Iterator[None]:
    with descriptors_for_the_client(4 * SERVER_OPEN_FILES):
        yield


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    opened = Sockets()
    yield opened
    opened.close_all()


@pytest.fixture(scope="module")
def patient() -> Iterator[Server]:
    """A server that waits long for requests (so slow connections stay), with a small
    per-address cap and 2,048 descriptors: it keeps half of them for its own work (a total
    cap of 1,024), and without caps the flood below would take every one."""
    srv = make_server(http_header_timeout_s=120, http_max_connections_per_address=64)
    srv.open_files = SERVER_OPEN_FILES
    yield srv.start()
    _stop(srv)


def test_connections_past_the_per_address_cap_are_refused_at_once(
    patient: Server, sockets: Sockets
) -> None:
    socks = [sockets.connect("127.0.0.3", patient) for _ in range(80)]
    assert until(lambda: sum(closed_or_answered(s) for s in socks) >= 16)
    refused = [s for s in socks if closed_or_answered(s)]
    assert len(refused) == 16, f"{len(refused)} of 80 refused; the cap is 64"
    for sock in refused:
        answer = wait_closed(sock, 10)
        assert answer is not None and answer.startswith(b"HTTP/1.1 429"), answer
        assert b"http_max_connections_per_address" in answer and b"127.0.0.3" in answer
    held = [s for s in socks if s not in refused]
    assert not any(closed_or_answered(s) for s in held), "a connection under the cap closed"
    other = httpx.HTTPTransport(local_address="127.0.0.4")
    with httpx.Client(transport=other, timeout=30) as elsewhere:
        assert elsewhere.get(patient.url + "/healthz").status_code == 200
    assert httpx.get(patient.url + "/healthz", timeout=30).status_code == 200


def test_a_command_starts_while_the_service_holds_over_1024_descriptors(
    patient: Server, sockets: Sockets
) -> None:
    """The service may now hold thousands of descriptors (it raises its soft limit): a local
    command's start handshake waited with select(), which cannot watch one past 1023."""
    # 1,024: the total cap, each address at its own.
    for i in range(1, 17):
        for _ in range(64):
            sockets.connect(f"127.0.2.{i}", patient)
    keyed = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=patient.url, headers=keyed, timeout=60) as api:
        made = api.post("/v1/sessions", json={"backend": "local"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        descriptors = server_descriptors(patient)
        assert descriptors > 1024, f"only {descriptors}: the test proves nothing"
        ran = api.post(f"/v1/sessions/{sid}/commands", json={"command": "echo hi"})
        assert ran.status_code == 200 and ran.json()["stdout"] == "hi\n", ran.text
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204


def test_thousands_of_slow_connections_leave_the_service_answering(
    patient: Server, sockets: Sockets
) -> None:
    keyed = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=patient.url, headers=keyed, timeout=30) as api:
        made = api.post("/v1/sessions", json={"backend": "local"})
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        assert api.post(f"/v1/sessions/{sid}/execute", json={"code": "0"}).status_code == 200
        before = server_descriptors(patient)  # the session's own, whatever its backend holds
        for source in FLOOD_ADDRESSES:
            for _ in range(FLOOD_PER_ADDRESS):
                sockets.connect(source, patient).sendall(PARTIAL_HEAD)
        assert len(sockets.opened) > SERVER_OPEN_FILES
        assert api.get("/healthz").status_code == 200
        done = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1 + 1"})
        assert done.status_code == 200 and done.json()["results"][0]["text"] == "2"
        descriptors = server_descriptors(patient)
        assert descriptors <= before + 1024 + 16, f"{before} before, {descriptors} after"
        assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    still_open = sum(not closed_or_answered(s) for s in sockets.opened)
    assert still_open <= 1024, f"{still_open} slow connections held; the cap is 1024"


BURSTS = 4
CROWD_CAP = 40


@pytest.fixture(scope="module")
def crowded() -> Iterator[Server]:
    """A server with room for 40 connections, 16 an address, whose deadlines are long (60 s
    for a head and for a terminal's key, bodies at a byte a second), so that nothing below is
    closed by them, however slow the machine."""
    srv = make_server(
        http_max_connections=CROWD_CAP,
        http_max_connections_per_address=16,
        http_header_timeout_s=60,
        terminal_auth_timeout_s=60,
        http_body_min_rate=1,
    ).start()
    yield srv
    _stop(srv)


def _terminal_without_a_key(sockets: Sockets, source: str, srv: Server) -> socket.socket:
    sock = sockets.connect(source, srv)
    sock.sendall(
        b"GET /v1/sessions/nope/terminal HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        + b"Sec-WebSocket-Key: "
        + base64.b64encode(os.urandom(16))
        + b"\r\n\r\n"
    )
    return sock


def _body_begun(sockets: Sockets, source: str, srv: Server, key: str | None) -> socket.socket:
    sock = sockets.connect(source, srv)
    keyed = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    path = b"/v1/sessions" if key else b"/nothing"
    sock.sendall(
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: localhost\r\n"
        + keyed
        + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        + b'{"backend": "local", "metadata": {"a": "'
    )
    return sock


def test_at_the_cap_connections_no_key_proves_make_room_whatever_they_do(
    crowded: Server, sockets: Sockets
) -> None:
    """Forty connections hold the cap: answers piling up for clients that pipeline requests
    and read none (14, the most, from one address), terminal sockets that send no key, bodies
    read before any key, and two keyed bodies under way. Before, none of them could be
    closed, and everyone else was answered 503 until they ended."""
    pipelining = [sockets.pipelining("127.0.3.1", crowded) for _ in range(14)]
    unkeyed_bodies = [_body_begun(sockets, "127.0.3.3", crowded, None) for _ in range(12)]
    keyed_bodies = [_body_begun(sockets, "127.0.3.4", crowded, KEY_A) for _ in range(2)]
    terminals = [_terminal_without_a_key(sockets, "127.0.3.2", crowded) for _ in range(12)]
    expected = {"127.0.3.1": 14, "127.0.3.2": 12, "127.0.3.3": 12, "127.0.3.4": 2}
    assert until(lambda: server_peers(crowded) == expected, within=10), server_peers(crowded)
    assert len(pipelining) + len(unkeyed_bodies) + len(keyed_bodies) + len(terminals) == 40

    with httpx.Client(base_url=crowded.url, timeout=30) as newcomer:
        assert newcomer.get("/healthz").status_code == 200  # its connection stays open
        keyed = {"Authorization": f"Bearer {KEY_A}"}
        with httpx.Client(base_url=crowded.url, headers=keyed, timeout=60) as api:
            assert api.get("/v1/sessions").status_code == 200
            # Each newcomer made room from the address that held the most: 14, then 13 (the
            # first newcomer's idle connection may have ended by uvicorn's keep-alive time on a
            # slow machine, and then the second found room without closing another).
            peers = server_peers(crowded)
            assert peers["127.0.3.1"] in (12, 13), peers
            assert peers["127.0.3.1"] + peers["127.0.0.1"] == 14, peers
            assert (peers["127.0.3.2"], peers["127.0.3.3"], peers["127.0.3.4"]) == (12, 12, 2)
            made = api.post("/v1/sessions", json={"backend": "local"})
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            done = api.post(f"/v1/sessions/{sid}/execute", json={"code": "1 + 1"})
            assert done.status_code == 200 and done.json()["results"][0]["text"] == "2"
            assert api.delete(f"/v1/sessions/{sid}").status_code == 204
    assert server_peers(crowded)["127.0.3.4"] == 2, "a keyed request under way was closed"
    assert not any(closed_or_answered(s) for s in keyed_bodies)


def test_a_burst_of_connects_never_runs_the_service_out_of_descriptors(
    sockets: Sockets,
) -> None:
    """3,000 connects waiting at once against a service limited to 1,024 files (a total cap of
    512): asyncio accepts a batch at each wake-up before the guard refuses any, and batches of
    256 ran the service out of descriptors (EMFILE: accepting paused, and anything else the
    service opened then failed). How many a wake-up finds waiting depends on how fast this
    process connects: a few bursts make a run of full batches near certain."""
    srv = make_server(http_header_timeout_s=60)
    srv.open_files = 1024
    srv.start()
    try:
        for _ in range(BURSTS):
            for i in range(3000):
                sock = socket.socket()
                sockets.opened.append(sock)
                sock.setblocking(False)
                sock.bind((f"127.0.{7 + i // 250}.{1 + i % 250}", 0))
                err = sock.connect_ex(("127.0.0.1", port_of(srv)))
                assert err in (0, errno.EINPROGRESS), os.strerror(err)
            # Every connect completed, and the server has accepted every one of them.
            assert all_connected(sockets.opened)
            assert until(lambda: accept_queue(srv) == 0)
            with httpx.Client(base_url=srv.url, timeout=30) as api:
                assert api.get("/healthz").status_code == 200
            sockets.close_all()
        log = srv.log.read_text()
        assert "out of system resource" not in log and "Too many open files" not in log
        assert "http_max_connections_per_address lowered from 512 to 256" in log
    finally:
        _stop(srv)
