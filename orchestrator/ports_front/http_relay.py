"""An HTTP request carried to a server in a sandbox, and its answer streamed back.

The request is spoken again to the server (httpcore's HTTP/1.1, over the relay's stream
through a network backend of our own: the connection is the service's `PortConnection`, not a
socket), with its body streamed in and the answer's streamed out, so neither is ever held whole.
One connection per request: the relay, not keep-alive, is what a connection costs here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import httpcore
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from orchestrator.ports_front.caller import HOP_BY_HOP, onward_headers
from orchestrator.service_parts.ports import PortConnection

Opener = Callable[[int], Awaitable[PortConnection]]
# Said by the service's own HTTP server: the server's would make two of each.
_SERVERS_OWN = frozenset({"date", "server"})
# The path form serves the sandbox's pages on the service's own origin: they run in a sandbox
# of the browser's (an opaque origin: no script of theirs reads the service's pages or sends
# its cookies), and set no cookie there. An app that needs its own origin, cookies or logins
# is reached by host (docs/ports.md).
_PATH_FORM_DROPPED = frozenset({"set-cookie", "set-cookie2", "content-security-policy"})
_PATH_FORM_POLICY = (
    "content-security-policy",
    "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads",
)
_CONNECT_TIMEOUT_S = 30.0


class RelayStream(httpcore.AsyncNetworkStream):
    """httpcore's view of one connection to a sandbox's port."""

    def __init__(self, connection: PortConnection) -> None:
        self.connection = connection

    async def read(
        self,
        max_bytes: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
    ) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self.connection.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout(f"the server sent nothing for {timeout} s") from None

    async def write(
        self,
        buffer: bytes,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
    ) -> None:
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                await self.connection.write(buffer)
        except TimeoutError:
            raise httpcore.WriteTimeout(f"the server took nothing for {timeout} s") from None
        except ConnectionResetError as exc:
            raise httpcore.WriteError(str(exc)) from None

    async def aclose(self) -> None:
        await self.connection.close()

    async def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS to a server in a sandbox is not relayed")

    def get_extra_info(self, info: str) -> Any:
        return None


class _OneConnection(httpcore.AsyncNetworkBackend):
    """A network backend whose every connection is one to the session's port."""

    def __init__(self, opener: Opener) -> None:
        self._opener = opener

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return RelayStream(await self._opener(port))

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("only a sandbox's ports are reached here")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _framing(request: Request) -> list[tuple[bytes, bytes]]:
    """How the body is framed to the server: its length as given, else chunked if the client
    sent one chunked; none for a request without a body."""
    length = request.headers.get("content-length")
    if length is not None:
        return [(b"content-length", length.encode("latin-1"))]
    if "chunked" in request.headers.get("transfer-encoding", "").lower():
        return [(b"transfer-encoding", b"chunked")]
    return []


async def relay_http(
    request: Request,
    opener: Opener,
    *,
    port: int,
    target: str,
    host: str,
    forwarded_prefix: str | None,
    timeout_s: float,
) -> Response:
    """Carry `request` to `port` (the path and query `target`, the Host `host`), answer with
    the server's answer. Raises the opener's refusals (PortUnreachable...) before anything is
    answered."""
    path_form = forwarded_prefix is not None
    headers = [
        h
        for h in onward_headers(request, path_form=path_form)
        if h[0].lower() not in (b"content-length", b"host")
    ]
    headers.insert(0, (b"host", host.encode("latin-1")))
    asked_host = request.headers.get("host", host)
    headers += _framing(request)
    client = request.client.host if request.client is not None else ""
    headers += [
        (b"x-forwarded-for", client.encode("latin-1")),
        (b"x-forwarded-proto", request.url.scheme.encode("latin-1")),
        (b"x-forwarded-host", asked_host.encode("latin-1")),
    ]
    if forwarded_prefix is not None:
        headers.append((b"x-forwarded-prefix", forwarded_prefix.encode("latin-1")))
    has_body = any(name in (b"content-length", b"transfer-encoding") for name, _ in headers)
    pool = httpcore.AsyncConnectionPool(
        network_backend=_OneConnection(opener), max_connections=1, keepalive_expiry=0.0
    )
    timeouts = {"connect": _CONNECT_TIMEOUT_S, "read": timeout_s, "write": timeout_s}
    try:
        answer = await pool.handle_async_request(
            httpcore.Request(
                request.method.encode("latin-1"),
                httpcore.URL(scheme=b"http", host=b"127.0.0.1", port=port, target=target),
                headers=headers,
                content=request.stream() if has_body else b"",
                extensions={"timeout": timeouts},
            )
        )
    except BaseException:
        await pool.aclose()
        raise
    named = {
        name.strip().lower()
        for key, value in answer.headers
        if key.lower() == b"connection"
        for name in value.decode("latin-1").split(",")
    }
    dropped = HOP_BY_HOP | named | _SERVERS_OWN | (_PATH_FORM_DROPPED if path_form else set())
    kept = [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in answer.headers
        if name.decode("latin-1").lower() not in dropped
    ]
    if path_form:
        kept.append(_PATH_FORM_POLICY)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_stream():
                yield chunk
        except (httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProtocolError):
            return  # cut short by the server, its end or its silence: the client sees it so
        finally:
            await answer.aclose()
            await pool.aclose()

    response = StreamingResponse(body(), status_code=answer.status)
    response.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in kept]
    return response
