"""Forwarding one plain-HTTP request (`GET http://host/path`) to the host the proxy dialled:
re-sent in origin form with `Connection: close`, the body streamed both ways through h11, which
checks the framing (Content-Length or chunked) on each side."""

from __future__ import annotations

import asyncio
import contextlib

import h11

from sandbox.egress.metering import CapReached, Meter
from sandbox.egress.pipe import CHUNK, send
from sandbox.egress.target import Target

# Headers that concern one hop, never forwarded. The framing headers (Content-Length,
# Transfer-Encoding) stay: h11 re-frames the body to match them.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"expect",
    }
)
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"host"})


def end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` without the hop-by-hop ones, those named in `Connection` included."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    } - _FRAMING
    return [(n, v) for n, v in headers if n not in _HOP_BY_HOP and n not in named]


class Forward:
    """One request's round trip between the client's h11 connection and the upstream stream."""

    def __init__(
        self,
        client: h11.Connection,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        meter: Meter,
        max_head_bytes: int,
        *,
        default_port: int = 80,
    ) -> None:
        """`default_port`: the port a Host header may leave out (443 inside a terminated TLS
        tunnel)."""
        self.client = client
        self.default_port = default_port
        self.client_reader = client_reader
        self.client_writer = client_writer
        self.upstream_reader = upstream_reader
        self.upstream_writer = upstream_writer
        self.meter = meter
        self.upstream = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head_bytes)

    async def run(self, request: h11.Request, target: Target) -> None:
        headers = end_to_end(list(request.headers))
        if not any(name == b"host" for name, _ in headers):
            headers.insert(0, (b"host", _authority(target, self.default_port).encode("ascii")))
        headers.append((b"connection", b"close"))
        head = h11.Request(method=request.method, target=target.path, headers=headers)
        await self._up(head)
        upload = asyncio.ensure_future(self._upload())
        download = asyncio.ensure_future(self._download())
        try:
            done, _ = await asyncio.wait({upload, download}, return_when=asyncio.FIRST_COMPLETED)
            if upload in done and upload.exception() is None:
                await download  # the request is sent; the answer comes
            else:
                # The answer is complete (a server may answer before reading the whole body),
                # or the upload failed: either way this round trip is over.
                for task in done:
                    task.result()
        finally:
            for task in (upload, download):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _up(self, event: h11.Event) -> None:
        data = self.upstream.send(event)
        if data:
            await send(self.upstream_writer, data, self.meter, up=True)

    async def _down(self, event: h11.Event) -> None:
        data = self.client.send(event)
        if data:
            self.client_writer.write(data)
            await self.client_writer.drain()
            self.meter.touch()

    async def _upload(self) -> None:
        """The request body, client to upstream, as it arrives."""
        if self.client.they_are_waiting_for_100_continue:
            await self._down(h11.InformationalResponse(status_code=100, headers=[]))
        while True:
            event = self.client.next_event()
            if event is h11.NEED_DATA:
                self.client.receive_data(await self.client_reader.read(CHUNK))
            elif isinstance(event, h11.Data):
                await self._up(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await self._up(h11.EndOfMessage(headers=list(event.headers)))
                return
            else:
                return

    async def _download(self) -> None:
        """The response, upstream to client, as it arrives."""
        while True:
            event = self.upstream.next_event()
            if event is h11.NEED_DATA:
                chunk = await self.upstream_reader.read(CHUNK)
                allowed = self.meter.take(chunk, up=False)
                if len(allowed) < len(chunk):
                    raise CapReached()
                self.upstream.receive_data(chunk)
            elif isinstance(event, h11.InformationalResponse):
                continue  # Expect was not forwarded, so only stray 1xx come: not the client's
            elif isinstance(event, h11.Response):
                headers = [*end_to_end(list(event.headers)), (b"connection", b"close")]
                response = h11.Response(
                    status_code=event.status_code, headers=headers, reason=event.reason
                )
                await self._down(response)
            elif isinstance(event, h11.Data):
                await self._down(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await self._down(h11.EndOfMessage())
                return
            else:
                raise ConnectionError("the destination closed before its response was complete")


def _authority(target: Target, default_port: int) -> str:
    host = f"[{target.host}]" if ":" in target.host else target.host
    return host if target.port == default_port else f"{host}:{target.port}"
