"""One inbound connection to a port inside a sandbox, carried over this process's stdin and
stdout (sandbox/port_relay.py starts it, once per connection, as a process of the sandbox).

The host never dials into the sandbox's network: this relay, inside it, dials the sandbox's own
loopback (127.0.0.1, then ::1) and copies bytes both ways. Once connected it writes one byte,
READY, before any of the server's, so the host can tell "connected" from "nothing listens";
failing, it writes the reason to stderr and exits with UNREACHABLE. It decides nothing: what
reaches it was already let through by the service.

Usage: python3 port_relay.py PORT (or its source through `python3 -c`).
Standard library only: it runs under each image's own Python.
"""

import os
import socket
import sys
import threading

READY = b"\x01"
UNREACHABLE = 3
CHUNK = 64 * 1024
CONNECT_TIMEOUT_S = 10.0


def _connect(port: int) -> socket.socket:
    errors = []
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect((address, port))
        except OSError as exc:
            sock.close()
            errors.append(f"{address}: {exc.strerror or exc}")
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise ConnectionError("; ".join(errors))


def _upstream(sock: socket.socket) -> None:
    """stdin to the server; its end is passed on as a half-close."""
    try:
        while chunk := os.read(0, CHUNK):
            sock.sendall(chunk)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    port = int(argv[0])
    try:
        sock = _connect(port)
    except (ConnectionError, OSError) as exc:
        os.write(2, f"nothing answers on port {port} in the sandbox ({exc})".encode())
        return UNREACHABLE
    os.write(1, READY)
    threading.Thread(target=_upstream, args=(sock,), daemon=True).start()
    try:
        while chunk := sock.recv(CHUNK):
            view = memoryview(chunk)
            while view:
                view = view[os.write(1, view) :]
    except OSError:
        pass
    return 0  # the server's end: the host sees stdout close, and the process go


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
