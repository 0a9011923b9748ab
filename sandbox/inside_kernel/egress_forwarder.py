"""Gives code in a sandbox a proxy at 127.0.0.1:3128 without giving the sandbox a network.

The sandbox's only interface is `lo`. The host's egress proxy listens on a Unix socket bound into
the sandbox; this forwarder, started in the sandbox's own network namespace before its kernel,
listens on the sandbox's loopback and pipes each connection to that socket unchanged. It decides
nothing: the proxy on the host reads every request and applies the session's policy, so code that
kills this forwarder, or talks to the socket itself, gains nothing.

Usage: python egress_forwarder.py --socket PATH --port N [--make-dir DIR]... -- COMMAND...
It binds the port first (so the proxy is there before the kernel's first line runs), leaves a
detached child serving it, and `exec`s COMMAND in its own place, keeping its pid.

Standard library only: it runs under each image's own Python.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import sys

CHUNK = 64 * 1024
MAX_CONNECTIONS = 256  # each holds two sockets and at most two chunks
_SHRUGGED_OFF = (
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTERM,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
)


def _listeners(port: int) -> list[socket.socket]:
    """Listening sockets on the IPv4 and (when the sandbox has it) IPv6 loopback."""
    found = []
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        # IPPROTO_TCP named: asyncio then sets TCP_NODELAY on each connection (it does only
        # for sockets that say TCP), so a relayed answer is not held back by Nagle's wait.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address, port))
            sock.listen(128)
        except OSError:
            sock.close()
            if family == socket.AF_INET:
                raise
            continue
        found.append(sock)
    return found


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of file, then pass the half-close on."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()


async def _serve(listeners: list[socket.socket], socket_path: str) -> None:
    slots = asyncio.Semaphore(MAX_CONNECTIONS)
    # Each connection's task, held: once the client has half-closed, nothing of the event loop
    # refers to it (asyncio keeps tasks weakly), and the garbage collector would end it with
    # the proxy's answer still on its way.
    running: set[asyncio.Task[object]] = set()

    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if slots.locked():
            client_w.close()
            return
        this = asyncio.current_task()
        if this is not None:
            running.add(this)
            this.add_done_callback(running.discard)
        async with slots:
            try:
                proxy_r, proxy_w = await asyncio.open_unix_connection(socket_path)
            except OSError:
                client_w.close()
                return
            try:
                await asyncio.gather(_pipe(client_r, proxy_w), _pipe(proxy_r, client_w))
            finally:
                for writer in (client_w, proxy_w):
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()

    servers = [await asyncio.start_server(forward, sock=sock) for sock in listeners]
    await asyncio.gather(*(server.serve_forever() for server in servers))


def _detach_and_serve(listeners: list[socket.socket], socket_path: str) -> None:
    """Serve in a grandchild: the kernel keeps this process's pid, and the server belongs to
    the sandbox's init, in a session of its own, so no signal meant for the kernel reaches it."""
    if os.fork() != 0:
        return
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    start = 3  # every other inherited descriptor closed, up to the highest one possible
    for fd in sorted(sock.fileno() for sock in listeners):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    # A signal meant for the kernel's group, or for every process (`kill -1`: on some
    # backends the kernel's group is the sandbox's init's), must not end the way out.
    for number in _SHRUGGED_OFF:
        signal.signal(number, signal.SIG_IGN)
    try:
        asyncio.run(_serve(listeners, socket_path))
    finally:
        os._exit(0)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("usage: egress_forwarder.py --socket PATH --port N [--make-dir DIR] -- COMMAND")
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--make-dir", action="append", default=[])
    options = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    for path in options.make_dir:  # before the kernel starts, so its imports find it
        with contextlib.suppress(OSError):
            os.makedirs(path, exist_ok=True)
    listeners = _listeners(options.port)
    _detach_and_serve(listeners, options.socket)
    # Reap the first child so it does not linger as a zombie of the kernel.
    with contextlib.suppress(ChildProcessError):
        os.wait()
    for sock in listeners:
        sock.close()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
