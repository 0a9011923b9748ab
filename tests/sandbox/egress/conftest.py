"""Fixtures of the egress proxy tests, all on loopback: a real upstream HTTP(S) server on
127.0.0.1, the proxy on a Unix socket, and a TCP relay standing in for the sandbox's forwarder
(each TCP connection piped unchanged to the proxy's socket), so real clients (curl, requests,
urllib) can use it as `http://127.0.0.1:<port>`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.egress import EgressLedger, EgressProxy, EgressRecord, EgressSettings
from sandbox.egress.credentials import CredentialBindings
from sandbox.egress.interception import TlsInterceptor
from sandbox.egress.slots import ConnectionSlots

ANY = NetworkPolicy(mode="any")
HELLO = b"hello from upstream\n"


class Upstream(BaseHTTPRequestHandler):
    """What the allowed test names lead to."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Seen-Host", self.headers.get("Host", ""))
        self.send_header("X-Seen-Path", self.path)
        self.send_header("X-Seen-Connection", self.headers.get("Connection", ""))
        self.send_header("X-Seen-Proxy-Authorization", self.headers.get("Proxy-Authorization", ""))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path == "/big":
            size = int(parse_qs(parts.query)["n"][0])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            block = b"x" * 65536
            sent = 0
            with contextlib.suppress(OSError):
                while sent < size:
                    piece = block[: size - sent]
                    self.wfile.write(piece)
                    sent += len(piece)
            return
        self._reply(HELLO)

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(HELLO)))
        self.end_headers()

    def do_POST(self) -> None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._reply(b"echo:" + body)


@dataclass
class UpstreamServer:
    port: int
    tls_port: int
    ca_file: str


def _self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for `allowed.test` (and the others), made with the openssl command."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=allowed.test",
            "-addext", "subjectAltName=DNS:allowed.test,DNS:other.test",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return str(key), str(cert)


@pytest.fixture(scope="session")
def upstream() -> Iterator[UpstreamServer]:
    plain = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    tls = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    with tempfile.TemporaryDirectory() as tmp:
        key, cert = _self_signed(Path(tmp))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        tls.socket = context.wrap_socket(tls.socket, server_side=True)
        threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (plain, tls)]
        for t in threads:
            t.start()
        try:
            yield UpstreamServer(plain.server_address[1], tls.server_address[1], cert)
        finally:
            for s in (plain, tls):
                s.shutdown()
                s.server_close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction of the relay, as the sandbox's forwarder does it: end of file passed on as
    a half-close, a reset passed on as a reset."""
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except OSError:
        writer.transport.abort()


@dataclass
class Running:
    """A proxy under test and how to reach it."""

    proxy: EgressProxy
    ledger: EgressLedger
    socket_path: Path
    relay_port: int
    seen: list[EgressRecord] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.relay_port}"

    async def records(self, count: int, within_s: float = 30.0) -> list[EgressRecord]:
        """The ledger's records once `count` connections have ended."""
        async with asyncio.timeout(within_s):
            while len(self.seen) < count:  # noqa: ASYNC110  (records come from another task)
                await asyncio.sleep(0.02)
        return list(self.ledger.records)


StartProxy = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_proxy() -> AsyncIterator[StartProxy]:
    """Start a proxy (policy, ceiling, settings of the test's choosing) with a relay in front."""
    cleanups: list[Callable[[], Awaitable[None]]] = []
    directory = Path(tempfile.mkdtemp(prefix="cir-egress-", dir="/tmp"))

    async def start(
        policy: NetworkPolicy | list[str] | str,
        *,
        ceiling: NetworkPolicy = ANY,
        peer_uid: int | None = None,
        slots: Sequence[ConnectionSlots] = (),
        credentials: CredentialBindings | None = None,
        interceptor: TlsInterceptor | None = None,
        **settings: Any,
    ) -> Running:
        seen: list[EgressRecord] = []
        ledger = EgressLedger("s-test", on_record=seen.append)
        chosen = (
            policy if isinstance(policy, NetworkPolicy) else NetworkPolicy.model_validate(policy)
        )
        proxy = EgressProxy(
            policy=chosen,
            ceiling=ceiling,
            settings=EgressSettings(**settings),
            ledger=ledger,
            slots=slots,
            credentials=credentials,
            interceptor=interceptor,
        )
        path = directory / f"proxy{len(cleanups)}.sock"
        await proxy.start(path, peer_uid=peer_uid, peer_gid=None)

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # Held here: once both sides have half-closed, nothing of the loop refers to this
            # task, and the garbage collector would end it with the answer still on its way.
            this = asyncio.current_task()
            assert this is not None
            relays.add(this)
            this.add_done_callback(relays.discard)
            try:
                up_reader, up_writer = await asyncio.open_unix_connection(str(path))
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            writer.close()
            up_writer.close()

        relays: set[asyncio.Task[object]] = set()
        server = await asyncio.start_server(relay, "127.0.0.1", 0)

        async def stop() -> None:
            server.close()
            await proxy.close()

        cleanups.append(stop)
        return Running(proxy, ledger, path, server.sockets[0].getsockname()[1], seen)

    yield start
    for cleanup in reversed(cleanups):
        await cleanup()
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()


def overrides(*names: str, to: str = "127.0.0.1") -> dict[str, tuple[str, ...]]:
    return {name: (to,) for name in names}


async def curl(*args: str, within_s: float = 60.0) -> tuple[int, str, str]:
    """Run curl (never through an environment proxy of the machine's)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    process = await asyncio.create_subprocess_exec(
        "curl", "-sS", "--max-time", str(int(within_s)), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def raw_exchange(port: int, data: bytes, *, within_s: float = 30.0) -> bytes:
    """Send `data` to the proxy (through the relay) and read until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(within_s):
            return await reader.read(-1)
    finally:
        writer.close()
