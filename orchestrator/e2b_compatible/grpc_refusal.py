"""gRPC refused plainly on the Connect routes, where this server cannot speak it.

gRPC (not gRPC-Web) ends every answer with HTTP trailers, which the ASGI server here does not
send: given a gRPC body, connectrpc raised and the caller got `500 unknown`, as if the service
had failed. It is refused before connectrpc sees it, with 415 and what to send instead (the
Connect protocol E2B's SDK speaks, or gRPC-Web).
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

_GRPC = "application/grpc"
_ACCEPTED = (
    "application/json, application/proto, application/connect+json, application/connect+proto"
)


def _is_grpc(content_type: str) -> bool:
    """As connectrpc picks its protocol: `application/grpc` or `application/grpc+<codec>`."""
    return content_type == _GRPC or content_type.startswith(_GRPC + "+")


class GrpcRefusal:
    """Wraps a Connect application: gRPC bodies get 415 unless the server can send trailers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "http.response.trailers" not in scope.get("extensions", {}):
            content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            if _is_grpc(content_type):
                await _refuse(send)
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send) -> None:
    message = (
        "gRPC needs HTTP trailers, which this server does not send: call with the Connect "
        "protocol (as E2B's SDK does) or gRPC-Web"
    )
    body = json.dumps({"code": "unimplemented", "message": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"accept-post", _ACCEPTED.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 415, "headers": headers})
    await send({"type": "http.response.body", "body": body})
