"""Raw loopback sockets for the connection tests: a client that sends what it likes, from the
loopback address it likes (127.0.0.2 and up, bound before connecting, so that the per-address
cap never touches the legitimate client on 127.0.0.1), and what the server holds of them."""

from __future__ import annotations

import contextlib
import resource
import select
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.orchestrator.service.conftest import Server

PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"
# A public answer of some 80 KiB: a few hundred of them are more than any socket's buffers.
PIPELINED = b"GET /openapi.json HTTP/1.1\r\nHost: localhost\r\n\r\n"


class Sockets:
    """The sockets a test opens: all closed when it ends, whatever happened."""

    def __init__(self) -> None:
        self.opened: list[socket.socket] = []

    def close_all(self) -> None:
        for sock in self.opened:
            sock.close()
        self.opened.clear()

    def connect(self, source: str, srv: Server, receive_buffer: int | None = None) -> socket.socket:
        sock = socket.socket()
        self.opened.append(sock)
        if receive_buffer is not None:  # small, and no autotuning: the server's answers pile up
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.bind((source, 0))
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port_of(srv)))
        return sock

    def pipelining(self, source: str, srv: Server, requests: int = 300) -> socket.socket:
        """A client that sends many requests at once and reads none of the answers."""
        sock = self.connect(source, srv, receive_buffer=4096)
        sock.sendall(PIPELINED * requests)
        return sock


@contextlib.contextmanager
def descriptors_for_the_client(wanted: int) -> Iterator[None]:
    """This process opens thousands of sockets itself: its soft limit is raised for the
    module's tests and put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        raise RuntimeError(f"the tests need {wanted} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def port_of(srv: Server) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def wait_closed(sock: socket.socket, within: float = 30) -> bytes | None:
    """All the server sent before it closed the connection, or None if it is still open."""
    deadline = time.monotonic() + within
    got = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


def closed_or_answered(sock: socket.socket) -> bool:
    """The server has closed the connection or sent something on it (not waiting)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return True


def trickle_until_closed(sock: socket.socket, within: float = 30) -> bytes | None:
    """Send a byte every 0.2 s until the server closes the connection: what it sent, or None
    if it was still open after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if closed_or_answered(sock):
            return wait_closed(sock, 10)
        try:
            sock.send(b"a")
        except (BrokenPipeError, ConnectionResetError):
            return wait_closed(sock, 10) or b""
        time.sleep(0.2)
    return None


def read_answer(sock: socket.socket) -> bytes:
    """The head of one whole HTTP answer (sized, or chunked), leaving the connection open."""
    sock.settimeout(30)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    sizes = [
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    if sizes:
        while len(body) < sizes[0]:
            body += sock.recv(65536)
    else:
        while not body.endswith(b"0\r\n\r\n"):
            body += sock.recv(65536)
    return head


def server_side(srv: Server) -> list[list[str]]:
    """The connections the server holds open, as its kernel lists them (Recv-Q, Send-Q, its
    address, the client's): one the server has closed is gone from here at once."""
    listed = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( sport = :{port_of(srv)} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split() for line in listed.splitlines()]


def server_peers(srv: Server) -> Counter[str]:
    """The client addresses of the connections the server holds open, counted."""
    return Counter(fields[-1].rsplit(":", 1)[0] for fields in server_side(srv))


def server_unread(srv: Server) -> int:
    """Bytes clients sent that the server has not read yet."""
    return sum(int(fields[0]) for fields in server_side(srv))


def accept_queue(srv: Server) -> int:
    """Connections the kernel holds for the server that it has not accepted yet."""
    listed = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port_of(srv)}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(listed[1])


def all_connected(socks: list[socket.socket], within: float = 30) -> bool:
    """Whether every non-blocking connect of `socks` completed (poll: they are thousands)."""
    waiting = select.poll()
    left = {sock.fileno() for sock in socks}
    for fileno in left:
        waiting.register(fileno, select.POLLOUT)
    deadline = time.monotonic() + within
    while left and time.monotonic() < deadline:
        for fileno, _ in waiting.poll(1000):
            waiting.unregister(fileno)
            left.discard(fileno)
    return not left


def server_descriptors(srv: Server) -> int:
    assert srv.process is not None
    return len(list(Path(f"/proc/{srv.process.pid}/fd").iterdir()))


def server_memory_mib(srv: Server) -> float:
    assert srv.process is not None
    status = Path(f"/proc/{srv.process.pid}/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(kib) / 1024


def until(condition: Callable[[], bool], within: float = 30) -> bool:
    """Whether `condition()` came true within `within` seconds (polled)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())
