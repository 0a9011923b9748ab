"""`X-Content-Type-Options: nosniff` on every response, so a browser never guesses a type (an
image or text a sandbox made must not be run as HTML or script)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_NOSNIFF = (b"x-content-type-options", b"nosniff")


class NoSniff:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != _NOSNIFF[0]]
                message = {**message, "headers": [*headers, _NOSNIFF]}
            await send(message)

        await self.app(scope, receive, send_with_header)
