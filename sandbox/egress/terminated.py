"""The pieces of a CONNECT the proxy terminates (sandbox/egress/interception.py): the sandbox's
side turned into a TLS server stream, and the request read inside it mapped to a path of the
CONNECT's own host, so nothing inside the tunnel can steer it (or a secret) elsewhere."""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

from sandbox.egress.pipe import CHUNK
from sandbox.egress.target import BadTarget, Target, split_authority

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def buffered(reader: asyncio.StreamReader) -> int:
    """How many bytes `reader` holds that were received but not read yet. asyncio offers no
    public way to ask (`at_eof` says nothing of them, a read would take them), so this looks at
    the StreamReader's private buffer (CPython's `_buffer`, a bytearray, since 3.4); were it
    ever missing, nothing is known buffered, as before."""
    buffer = getattr(reader, "_buffer", None)
    return len(buffer) if isinstance(buffer, bytearray) else 0


async def serve_tls(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: ssl.SSLContext,
    handshake_timeout_s: float,
) -> Streams:
    """New streams speaking TLS, as the server, over the connection of `reader` and `writer`,
    whose plain reader must hold no unread byte (it would be lost to the TLS layer). Why not
    `StreamWriter.start_tls`: it takes the client's side for a stream opened as a client, which
    the proxy's accepted sockets are (`open_unix_connection(sock=...)`)."""
    loop = asyncio.get_running_loop()
    await writer.drain()
    # `loop.start_tls` stops reading before it first awaits: bytes not buffered now reach TLS.
    if buffered(reader):
        raise ConnectionError("bytes arrived before the TLS handshake could start")
    reader = asyncio.StreamReader(limit=CHUNK)
    protocol = asyncio.StreamReaderProtocol(reader)
    transport = await loop.start_tls(
        writer.transport,
        protocol,
        context,
        server_side=True,
        ssl_handshake_timeout=handshake_timeout_s,
    )
    if transport is None:  # the connection ended during the handshake
        raise ConnectionError("the sandbox closed the connection during the TLS handshake")
    protocol.connection_made(transport)  # start_tls does not tell the new protocol
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


def inner_path(raw: bytes, target: Target) -> str:
    """The origin-form path of a request read inside a terminated tunnel to `target`. An
    absolute `https://` target must name the tunnel's own host and port."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadTarget("the request target must be ASCII") from None
    if text.startswith("/"):
        return text
    parts = urlsplit(text)
    if parts.scheme.lower() != "https" or not parts.netloc or "@" in parts.netloc:
        raise BadTarget(
            f"{text[:80]!r}: inside a TLS tunnel, send an origin-form path (GET /path) or "
            "https:// URL of the tunnel's host"
        )
    host, port = split_authority(parts.netloc)
    if host != target.host or (port or 443) != target.port:
        raise BadTarget(
            f"{text[:80]!r} does not name the tunnel's destination {target.host}:{target.port}"
        )
    path = parts.path or "/"
    return f"{path}?{parts.query}" if parts.query else path
