"""Runs inside a sandbox, in front of a kernel that cannot be reached the way the host needs.

The host reaches every kernel over ZeroMQ `ipc` sockets in a directory bound into the sandbox,
because the sandbox has no network the host could use. Some kernels bind TCP only (Deno's,
jjava's JeroMQ); others ignore Jupyter's `interrupt_request` and stop only on SIGINT (IRkernel).
This supervisor, started as the sandbox's kernel process, fixes both without the host knowing:

- relay: it gives the kernel a connection file of TCP ports on 127.0.0.1 inside the sandbox's
  own network namespace, listens on the ipc socket paths the host's connection file names, and
  copies bytes both ways (ZeroMQ's wire protocol passes through a byte stream unchanged);
- interrupt: it listens on `interrupt` in the kernel directory and sends the kernel SIGINT for
  each byte it reads there.

It exits with the kernel's status, so the host sees the kernel's death as before. Standard
library only: it runs under whatever Python the sandbox has.

    python kernel_supervisor.py --connection-file F [--relay] [--interrupt-socket P] -- ARGV...

`{connection_file}` in ARGV is replaced by the file the kernel should read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from typing import Any

_CHANNELS = ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port")
_CHUNK = 1 << 16
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", 12)  # Linux's
PLACEHOLDER = "{connection_file}"


def _free_ports(count: int) -> list[int]:
    """Ports free on the sandbox's loopback now (the sandbox's own namespace: nobody races)."""
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _tcp_connection_file(path: str, info: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """Write the kernel's TCP connection file beside `path`; return it and each ipc port's TCP
    port."""
    ports = dict(zip(_CHANNELS, _free_ports(len(_CHANNELS)), strict=True))
    tcp = {**info, **ports, "transport": "tcp", "ip": "127.0.0.1"}
    target = path.removesuffix(".json") + "-tcp.json"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tcp, f)
    return target, {f"{info['ip']}-{info[name]}": ports[name] for name in _CHANNELS}


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ack_now: socket.socket | None = None
) -> None:
    try:
        while data := await reader.read(_CHUNK):
            if ack_now is not None:
                _ack_now(ack_now)
            writer.write(data)
            await writer.drain()  # back-pressure: never more than a chunk or two in flight
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _ack_now(sock: socket.socket) -> None:
    """Acknowledge what the kernel sent at once. Deno's kernel leaves Nagle's algorithm on, so
    each small message it writes while one is unacknowledged waits for that ACK, which Linux
    delays up to 40 ms: quick ACKs (a flag Linux clears again, hence after each read) keep
    its back-to-back messages (a reply, then the next request's) from stalling."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)


async def _relay_one(port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        kernel_reader, kernel_writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:  # not listening yet: ZeroMQ on the host connects again by itself
        writer.close()
        return
    kernel_socket = kernel_writer.get_extra_info("socket")
    await asyncio.gather(_pipe(reader, kernel_writer), _pipe(kernel_reader, writer, kernel_socket))


async def _serve_relay(routes: dict[str, int]) -> list[asyncio.AbstractServer]:
    servers: list[asyncio.AbstractServer] = []
    for path, port in routes.items():

        async def handle(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int = port
        ) -> None:
            await _relay_one(port, reader, writer)

        servers.append(await asyncio.start_unix_server(handle, path=path))
    return servers


async def _serve_interrupts(
    path: str, kernel: asyncio.subprocess.Process
) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(1):
                if kernel.returncode is None:
                    kernel.send_signal(signal.SIGINT)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    return await asyncio.start_unix_server(handle, path=path)


async def supervise(args: argparse.Namespace) -> int:
    connection_file: str = args.connection_file
    routes: dict[str, int] = {}
    if args.relay:
        with open(connection_file) as f:  # noqa: ASYNC230 - before anything else runs
            info = json.load(f)
        connection_file, routes = _tcp_connection_file(connection_file, info)
    argv = [connection_file if a == PLACEHOLDER else a for a in args.argv]
    servers = await _serve_relay(routes)
    kernel = await asyncio.create_subprocess_exec(*argv)
    if args.interrupt_socket:
        servers.append(await _serve_interrupts(args.interrupt_socket, kernel))
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(signum, kernel.send_signal, signum)
    loop.add_signal_handler(signal.SIGINT, kernel.send_signal, signal.SIGINT)
    code = await kernel.wait()
    for server in servers:
        server.close()
    return 128 - code if code < 0 else code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connection-file", required=True)
    parser.add_argument("--relay", action="store_true")
    parser.add_argument("--interrupt-socket")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.argv and args.argv[0] == "--":
        args.argv = args.argv[1:]
    if not args.argv:
        parser.error("the kernel's command line is missing")
    sys.exit(asyncio.run(supervise(args)))


if __name__ == "__main__":
    main()
