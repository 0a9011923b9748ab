"""Headers set on every response, at the ASGI level (so streamed answers and errors get them
too): `X-Content-Type-Options: nosniff` on the whole service, so a browser never guesses a type
(an image or text a sandbox made must not be run as HTML or script); the console adds its own
(`orchestrator/console/headers.py`)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

Headers = list[tuple[bytes, bytes]]

_NOSNIFF = (b"x-content-type-options", b"nosniff")


class ResponseHeaders:
    """A middleware that rewrites each HTTP response's headers as `headers_for` says."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def headers_for(self, scope: Scope, headers: Headers) -> Headers:
        """The headers a response to `scope` starts with, given those its route set."""
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                given = list(message.get("headers", []))
                message = {**message, "headers": self.headers_for(scope, given)}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class NoSniff(ResponseHeaders):
    def headers_for(self, scope: Scope, headers: Headers) -> Headers:
        return [*(h for h in headers if h[0].lower() != _NOSNIFF[0]), _NOSNIFF]
