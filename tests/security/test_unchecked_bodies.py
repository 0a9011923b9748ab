"""Bodies sent where no key is checked before they are read (public pages, the console's forms,
unknown paths) stay small, against a real server: the request guard read them whole for its
JSON depth check, up to 16 MiB, or 100 MiB for any path that merely ended in `/files`; four
unfinished ones took the service from 133 to 499 MiB."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator

import pytest

from tests.orchestrator.service.conftest import Server, leftovers, make_server
from tests.security.raw_sockets import (
    Sockets,
    server_memory_mib,
    server_unread,
    until,
    wait_closed,
)

BODY = 40 << 20
CHUNK = b"[" * (1 << 20)


@pytest.fixture
def server() -> Iterator[Server]:
    """A server of its own for each test: memory freed after one is not handed back."""
    srv = make_server().start()
    yield srv
    srv.stop()
    assert leftovers(srv) == []
    shutil.rmtree(srv.state_dir.parent, ignore_errors=True)


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    opened = Sockets()
    yield opened
    opened.close_all()


def _send_body(sock: socket.socket, path: str, *, announced: bool) -> None:
    """Start a JSON body of 40 MiB (announced, or chunked with no length) and send all but its
    end, as long as the server reads it."""
    framing = f"Content-Length: {BODY + 1}" if announced else "Transfer-Encoding: chunked"
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n".encode()
    )
    chunk = CHUNK if announced else f"{len(CHUNK):x}\r\n".encode() + CHUNK + b"\r\n"
    try:
        for _ in range(BODY // len(CHUNK)):
            sock.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused and closed: what the server should do


@pytest.mark.parametrize("announced", [True, False], ids=["announced", "chunked"])
def test_bodies_no_key_is_checked_for_stay_small(
    server: Server, sockets: Sockets, announced: bool
) -> None:
    paths = ["/no/such/files", "/console/x/files", "/healthz/files", "/console/login"]
    before = server_memory_mib(server)
    for i, path in enumerate(paths):
        sock = sockets.connect(f"127.0.9.{i + 1}", server)
        sock.settimeout(30)
        _send_body(sock, path, announced=announced)
    assert until(lambda: server_unread(server) == 0), "the server stopped reading"
    grown = server_memory_mib(server) - before
    assert grown < 32, f"the service grew by {grown:.0f} MiB holding bodies no key was checked for"


def test_an_announced_large_body_is_refused_before_it_is_read(
    server: Server, sockets: Sockets
) -> None:
    sock = sockets.connect("127.0.9.9", server)
    sock.sendall(
        b"POST /console/login HTTP/1.1\r\nHost: localhost\r\nContent-Length: 70000\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\n\r\n"
    )
    answer = wait_closed(sock, 10)
    assert answer is not None and answer.startswith(b"HTTP/1.1 413"), answer
    assert b"65536" in answer, answer
