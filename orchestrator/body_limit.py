"""Refuses request bodies over a size limit while they arrive, before they are held in memory or
spooled to disk (Starlette spools multipart uploads before any handler could check them)."""

from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The routes that take an upload: ours (a session's files, a volume's), and E2B's (at its two
# prefixes). Exactly these: a path that merely ends the same way gets the ordinary limit
# (tests/orchestrator/test_body_routes.py).
# An announced body this far over its limit is not read to its end before the connection
# closes (reading it would cost more than a client's retry).
DRAIN_BYTES = 64 << 20
_UPLOADS = re.compile(r"/v1/(sessions|volumes)/[^/]+/files|(/e2b)?/files")
_PUT_UPLOADS = re.compile(r"(/e2b)?/volumecontent/[^/]+/file")  # E2B's volume files


def is_upload(method: str, path: str) -> bool:
    if method == "PUT":
        return _PUT_UPLOADS.fullmatch(path) is not None
    return method == "POST" and _UPLOADS.fullmatch(path) is not None


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, *, limit: int, upload_limit: int) -> None:
        self.app = app
        self.limit = limit
        self.upload_limit = upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Multipart framing adds a little to the file itself.
        uploading = is_upload(scope["method"], scope["path"])
        limit = self.upload_limit + 64 * 1024 if uploading else self.limit
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                # The client is still sending what it announced. Closing now, with its bytes
                # unread, makes the kernel reset the connection, and the client may lose the
                # answer with it: a body within DRAIN_BYTES of the limit is read and thrown
                # away (uvicorn does, unstored) and the answer arrives whole.
                await self._refuse(send, limit, close=int(value) > limit + DRAIN_BYTES)
                return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, limit)

    @staticmethod
    async def _refuse(send: Send, limit: int, *, close: bool = True) -> None:
        body = (
            b'{"error":{"type":"TooLarge","message":"the request body is larger than the limit of '
            + str(limit).encode()
            + b' bytes"}}'
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *([(b"connection", b"close")] if close else []),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
