"""The body-size middleware, driven as ASGI with hand-made messages: a body over its limit is
refused with 413 as it arrives, announced or not, before the app keeps it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from starlette.types import Message, Receive, Scope, Send

from orchestrator.body_limit import DRAIN_BYTES, BodySizeLimit, BodyTooLarge

pytestmark = pytest.mark.unit

LIMIT = 1000
UPLOAD_LIMIT = 100_000
MULTIPART_ROOM = 64 * 1024


@dataclass
class Reader:
    """An app that reads the whole body, then answers 200 with how much it got."""

    read: bytes = b""
    called: bool = False
    respond_first: bool = False  # start the answer before reading (as a streaming app might)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.called = True
        if self.respond_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        while True:
            message = await receive()
            self.read += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if not self.respond_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(self.read)).encode()})


@dataclass
class Exchange:
    sent: list[Message] = field(default_factory=list)

    @property
    def status(self) -> int:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        assert len(starts) == 1, self.sent
        status: int = starts[0]["status"]
        return status

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def headers(self) -> dict[bytes, bytes]:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return dict(start["headers"])


def http(method: str, path: str, content_length: int | bytes | None = None) -> Scope:
    headers = [(b"host", b"127.0.0.1")]
    if isinstance(content_length, int):
        content_length = str(content_length).encode()
    if content_length is not None:
        headers.append((b"content-length", content_length))
    return {"type": "http", "method": method, "path": path, "headers": headers}


def chunks(*parts: bytes) -> Callable[[], Awaitable[Message]]:
    messages: list[Message] = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]
    pulled = 0

    async def receive() -> Message:
        nonlocal pulled
        if pulled == len(messages):
            return {"type": "http.disconnect"}
        pulled += 1
        return messages[pulled - 1]

    return receive


async def call(app: Reader, scope: Scope, receive: Receive) -> Exchange:
    exchange = Exchange()

    async def send(message: Message) -> None:
        exchange.sent.append(message)

    await BodySizeLimit(app, limit=LIMIT, upload_limit=UPLOAD_LIMIT)(scope, receive, send)
    return exchange


def assert_refused(exchange: Exchange, limit: int, *, drained: bool = False) -> None:
    """`drained`: refused on its announced length, which is close enough to the limit that the
    rest of the body is read and thrown away, so the connection is kept (closing with the
    client's bytes unread resets it, and the client may lose the answer)."""
    assert exchange.status == 413
    assert exchange.headers[b"content-type"] == b"application/json"
    if drained:
        assert b"connection" not in exchange.headers
    else:
        assert exchange.headers[b"connection"] == b"close"
    assert int(exchange.headers[b"content-length"]) == len(exchange.body)
    assert json.loads(exchange.body) == {
        "error": {
            "type": "TooLarge",
            "message": f"the request body is larger than the limit of {limit} bytes",
        }
    }


async def test_a_body_within_the_limit_reaches_the_app() -> None:
    app = Reader()
    exchange = await call(app, http("POST", "/v1/sessions", LIMIT), chunks(b"x" * LIMIT))
    assert (exchange.status, exchange.body) == (200, str(LIMIT).encode())


async def test_an_announced_length_over_the_limit_is_refused_before_the_app_runs() -> None:
    app = Reader()
    exchange = await call(app, http("POST", "/v1/sessions", LIMIT + 1), chunks(b""))
    assert_refused(exchange, LIMIT, drained=True)
    assert app.called is False
    # Far over the limit, the rest is not worth reading: the connection closes.
    huge = LIMIT + DRAIN_BYTES + 1
    exchange = await call(app, http("POST", "/v1/sessions", huge), chunks(b""))
    assert_refused(exchange, LIMIT)
    assert app.called is False


async def test_an_unannounced_body_is_refused_once_it_passes_the_limit() -> None:
    app = Reader()
    receive = chunks(b"x" * 600, b"x" * 600, b"x" * 10_000_000)
    exchange = await call(app, http("POST", "/v1/sessions"), receive)
    assert_refused(exchange, LIMIT)
    assert len(app.read) == 600  # the chunk that went over never reached the app


async def test_a_length_that_lies_low_is_caught_by_counting() -> None:
    app = Reader()
    receive = chunks(b"x" * (LIMIT + 1))
    exchange = await call(app, http("POST", "/v1/sessions", 10), receive)
    assert_refused(exchange, LIMIT)


@pytest.mark.parametrize("value", [b"abc", b"-5", b"+5000", b"", b"1e9"])
async def test_an_unreadable_length_falls_back_to_counting(value: bytes) -> None:
    small = await call(Reader(), http("POST", "/v1/x", value), chunks(b"x" * 10))
    assert small.status == 200
    big = await call(Reader(), http("POST", "/v1/x", value), chunks(b"x" * (LIMIT + 1)))
    assert_refused(big, LIMIT)


async def test_an_upload_gets_the_upload_limit_plus_room_for_multipart() -> None:
    upload_limit = UPLOAD_LIMIT + MULTIPART_ROOM
    path = "/v1/sessions/s1/files"
    fits = await call(Reader(), http("POST", path, upload_limit), chunks(b"x" * upload_limit))
    assert fits.status == 200
    over = await call(Reader(), http("POST", path, upload_limit + 1), chunks(b""))
    assert_refused(over, upload_limit, drained=True)
    streamed = await call(Reader(), http("POST", path), chunks(b"x" * (upload_limit + 1)))
    assert_refused(streamed, upload_limit)


@pytest.mark.parametrize("path", ["/files", "/e2b/files"])
async def test_e2b_uploads_get_the_upload_limit(path: str) -> None:
    upload_limit = UPLOAD_LIMIT + MULTIPART_ROOM
    fits = await call(Reader(), http("POST", path, upload_limit), chunks(b"x" * upload_limit))
    assert fits.status == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("PUT", "/v1/sessions/s1/files"),  # only POST uploads
        ("POST", "/v1/sessions/s1/files/a.csv"),
        ("POST", "/v1/sessions/s1/execute"),
        # Paths that merely end like an upload route (they used to get its limit, before any
        # key was checked): only the routes themselves take uploads.
        ("POST", "/no/such/files"),
        ("POST", "/v1/sessions/s1/processes/files"),
        ("POST", "/console/files"),
        ("POST", "/e2b/x/files"),
    ],
)
async def test_other_requests_keep_the_small_limit(method: str, path: str) -> None:
    exchange = await call(Reader(), http(method, path, LIMIT + 1), chunks(b""))
    assert_refused(exchange, LIMIT, drained=True)


async def test_once_the_answer_has_started_no_second_answer_is_sent() -> None:
    app = Reader(respond_first=True)
    exchange = await call(app, http("POST", "/v1/x"), chunks(b"x" * 600, b"x" * 600))
    assert [m["type"] for m in exchange.sent] == ["http.response.start"]
    assert exchange.status == 200  # what the app began; the connection carries nothing more


async def test_the_app_may_answer_the_error_itself() -> None:
    """Inside FastAPI, BodyTooLarge is an HTTPException that the app's own handlers answer."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await receive()
        except BodyTooLarge as exc:
            await send({"type": "http.response.start", "status": exc.status_code, "headers": []})
            await send({"type": "http.response.body", "body": exc.detail.encode()})

    exchange = Exchange()

    async def send(message: Message) -> None:
        exchange.sent.append(message)

    await BodySizeLimit(app, limit=LIMIT, upload_limit=UPLOAD_LIMIT)(
        http("POST", "/v1/x"), chunks(b"x" * (LIMIT + 1)), send
    )
    assert exchange.status == 413
    assert exchange.body == f"the request body is larger than the limit of {LIMIT} bytes".encode()


async def test_a_disconnect_is_not_counted_as_body() -> None:
    async def disconnects() -> Message:
        return {"type": "http.disconnect", "body": b"x" * (LIMIT + 1)}

    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())

    await BodySizeLimit(app, limit=LIMIT, upload_limit=UPLOAD_LIMIT)(
        http("POST", "/v1/x"), disconnects, discard
    )
    assert seen[0]["type"] == "http.disconnect"


async def discard(message: Message) -> None:
    """A `send` for apps that answer nothing here."""


@pytest.mark.parametrize("kind", ["lifespan", "websocket"])
async def test_other_scopes_pass_through_untouched(kind: str) -> None:
    seen: list[tuple[Scope, Message]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append((scope, await receive()))

    big: Message = {"type": f"{kind}.receive", "body": b"x" * (LIMIT * 10)}

    async def receive() -> Message:
        return big

    scope: Scope = {"type": kind, "path": "/", "headers": [(b"content-length", b"999999999")]}
    await BodySizeLimit(app, limit=LIMIT, upload_limit=UPLOAD_LIMIT)(scope, receive, discard)
    assert seen == [(scope, big)]
