"""The gate every HTTP request passes before the app, or any parser, sees its body.

1. Who is calling is settled from the headers alone, by path family: a bearer key for /v1, /mcp
   and /metrics; an API key for E2B's control plane; a sandbox id and its access token for E2B's
   data plane and its Connect services; a volume's token (or an API key) for E2B's volume
   files. The console (/console) is a family of its own: people log in there with a form, so
   its pages check their login cookie themselves, on every request. FastAPI reads and parses a
   body before it resolves the dependencies that authenticate, and the Connect application
   parses before its handler runs: without this gate, anyone could have any parser read
   anything.
2. A body that a JSON parser will read is measured first (see json_depth): nesting deeper than
   `max_json_depth` is refused with 400, because protobuf's JSON parser crashed the whole
   process on ~30,000 levels. Large bodies are measured in a worker thread. File uploads,
   octet-stream and other non-JSON bodies pass unmeasured: their brackets are data. A Connect
   client stream (input typed into a process) is not read whole first, which would hold its
   input back until the client ends it: each message is measured as it arrives.
3. Families whose caller no key proves before the app (public pages, the console's forms, paths
   the app answers 404) may send at most 64 KiB of body, whatever its type: else anyone could
   make the service hold bodies of up to the size limit in memory. Whoever is proven is told to
   the HTTP server (orchestrator/caller_mark.py): until then, its connection may be closed to
   make room for others.

Refusals come in the shape each family's clients parse: ours (`{"error": {...}}`), E2B's
(`{"code": <status>, ...}`) or Connect's (`{"code": "unauthenticated", ...}`).
"""

from __future__ import annotations

import email.message
import functools
import json
import re
from enum import Enum
from urllib.parse import unquote_to_bytes

import anyio.to_thread
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from fastapi import HTTPException
from starlette._utils import get_route_path
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.auth import Authenticator, WrongKeysThrottled, client_address
from orchestrator.body_limit import is_upload
from orchestrator.caller_mark import caller_proven
from orchestrator.console import PREFIX as CONSOLE_PREFIX
from orchestrator.e2b_compatible.front import PREFIX as E2B_PREFIX
from orchestrator.e2b_compatible.sandboxes import REFUSALS, E2BSandboxes, SandboxGone
from orchestrator.e2b_compatible.signed_urls import SignedFile, SignedFileRequest, SignedUrlRefused
from orchestrator.e2b_compatible.volume_content import PREFIX as VOLUME_CONTENT
from orchestrator.e2b_compatible.volume_content import owner_of_call
from orchestrator.key_throttle import TooManyWrongKeys
from orchestrator.metrics import METRICS
from sandbox.json_depth import nests_deeper_than

_MEASURE_IN_A_THREAD = 256 * 1024  # bytes; smaller bodies are measured on the event loop
# A body no key has been checked for: the console's forms and anything public need less.
UNCHECKED_BODY_MAX = 64 * 1024
_STDIN = re.compile(r"/v1/sessions/[^/]+/processes/[^/]+/stdin")
_PORTS = re.compile(r"/v1/sessions/[^/]+/ports/[^/]+(/|$)")
_PUBLIC = frozenset({"/healthz", "/health", "/docs", "/docs/oauth2-redirect", "/redoc"})
_CONNECT_SERVICES = ("/filesystem.Filesystem/", "/process.Process/")
_E2B_DATA = ("/execute", "/contexts", "/files")
_CODE_INTERPRETER = ("/execute", "/contexts")
# Connect calls whose request is a stream of messages handled as they come.
_CLIENT_STREAMS = ("/process.Process/StreamInput",)
_ENVELOPE_HEADER = 5
_MAX_STREAMED_MESSAGE = 4 << 20  # connectrpc's own default per-message limit


class Family(Enum):
    PUBLIC = "public"
    BEARER = "bearer"  # /v1, /mcp, and /metrics unless it is public
    E2B_CONTROL = "e2b-control"
    E2B_DATA = "e2b-data"
    E2B_VOLUME = "e2b-volume"  # a volume's files: its volume token, or an API key
    CONNECT = "connect"
    CONSOLE = "console"  # the web console: its pages check their login cookie
    # A session's ports (orchestrator/ports_front/): the caller is a key, a port token or
    # anyone (public ports), settled by the route before it reads the body, which is the
    # app's own and goes on as it comes (capped by the body size limit alone).
    PORTS = "ports"
    OTHER = "other"  # answered 404 by the app; its body is still measured


# The families whose caller's key (or sandbox token) is checked before the app runs.
_CHECKED = frozenset(
    {Family.BEARER, Family.E2B_CONTROL, Family.E2B_DATA, Family.E2B_VOLUME, Family.CONNECT}
)


def _e2b_path(path: str) -> str:
    """An E2B route's path as the front's router sees it (the front answers under /e2b too)."""
    return path[len(E2B_PREFIX) :] if path.startswith(E2B_PREFIX + "/") else path


class Refused(Exception):
    """A request the gate answers itself; `headers`: more of the answer's (Retry-After)."""

    def __init__(
        self, status: int, kind: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}


# Connect's codes for the HTTP statuses the gate answers with (connectrpc.com/docs/protocol).
_CONNECT_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    429: "resource_exhausted",
    503: "unavailable",
}


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        authenticate: Authenticator,
        sandboxes: E2BSandboxes | None,
        max_json_depth: int,
        metrics_public: bool,
    ) -> None:
        self.app = app
        self.authenticate = authenticate
        self.sandboxes = sandboxes  # None: the E2B front is off
        self.max_json_depth = max_json_depth
        self.metrics_public = metrics_public

    def family(self, path: str) -> Family:
        if path in _PUBLIC or path == "/openapi.json":
            return Family.PUBLIC
        if path == "/metrics":
            return Family.PUBLIC if self.metrics_public else Family.BEARER
        if _PORTS.match(path):
            return Family.PORTS
        if path == "/v1" or path.startswith("/v1/") or path in ("/mcp", "/mcp/"):
            return Family.BEARER
        if path == CONSOLE_PREFIX or path.startswith(CONSOLE_PREFIX + "/"):
            return Family.CONSOLE
        if self.sandboxes is None:
            return Family.OTHER
        path = _e2b_path(path)
        if path.startswith(_CONNECT_SERVICES):
            return Family.CONNECT
        if path.startswith(("/sandboxes", "/v2/sandboxes")):
            return Family.E2B_CONTROL
        if path == "/volumes" or path.startswith("/volumes/"):
            return Family.E2B_CONTROL
        if path.startswith(VOLUME_CONTENT):
            return Family.E2B_VOLUME
        if path == "/health":
            return Family.PUBLIC
        if path.startswith(_E2B_DATA):
            return Family.E2B_DATA
        return Family.OTHER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = get_route_path(scope)
        family = self.family(path)
        if family is Family.PORTS:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            await self._check_caller(family, request)
            if family not in _CHECKED:
                body, more = await self._read_unchecked(request, receive)
            else:
                streams = family is Family.CONNECT and _is_client_stream(path)
                caller_proven(scope, streams_body=streams)
                if family is Family.CONNECT:
                    _refuse_compressed(request)
                    if scope["method"] == "GET":
                        # Connect's GET form carries the message in the query string.
                        await self._check_depth(unquote_to_bytes(scope.get("query_string", b"")))
                if streams:
                    # Its messages are handled as they come (input typed into a process): each
                    # is measured as it arrives, never the whole body first.
                    await self.app(scope, self._measured_envelopes(receive), send)
                    return
                # Connect picks its JSON codec from content types this gate need not know:
                # every body it reads is measured, whatever it claims to be.
                if not (family is Family.CONNECT or _read_as_json(request)):
                    await self.app(scope, receive, send)
                    return
                body, more = await _read_body(receive)
                await self._check_depth(body)
        except Refused as refused:
            await _answer(send, family, refused)
            return
        await self.app(scope, _replay(body, more, receive), send)

    async def _check_caller(self, family: Family, request: Request) -> None:
        try:
            if family is Family.BEARER:
                self.authenticate(request)
            elif family is Family.E2B_CONTROL:
                key = _api_key(request)
                if not key and not self.authenticate.disabled:
                    raise Refused(
                        401,
                        "Unauthorized",
                        "missing API key: send one of this service's keys as X-API-Key",
                    )
                self.authenticate.owner_for_key(key, client_address(request))
            elif family in (Family.E2B_DATA, Family.CONNECT):
                await self._check_sandbox(request)
            elif family is Family.E2B_VOLUME:
                assert self.sandboxes is not None
                owner_of_call(self.authenticate, self.sandboxes.service, request)
        except HTTPException as exc:
            kind = getattr(exc, "kind", "Unauthorized")  # WrongKeysThrottled names its own
            raise Refused(exc.status_code, kind, str(exc.detail), dict(exc.headers or {})) from None

    async def _check_sandbox(self, request: Request) -> None:
        assert self.sandboxes is not None
        sandbox_id = request.headers.get("e2b-sandbox-id")
        token = request.headers.get("x-access-token") or request.headers.get(
            "e2b-traffic-access-token"
        )
        if token is None and _e2b_path(get_route_path(request.scope)) == "/files":
            signed = await self._signed_file(request)
            if signed is not None:
                sandbox_id, token = signed.sandbox_id, signed.token
        if not sandbox_id:
            raise Refused(
                401,
                "Unauthorized",
                "missing the E2b-Sandbox-Id header (and the sandbox's X-Access-Token)",
            )
        # The code interpreter's own routes are a port of the sandbox, open to its public
        # traffic as on E2B (E2B's v1 SDK sends them no token); envd's and files are not.
        port_traffic = _e2b_path(get_route_path(request.scope)).startswith(_CODE_INTERPRETER)
        try:
            await self.sandboxes.reachable(sandbox_id, token, port_traffic=port_traffic)
        except SandboxGone as exc:
            # E2B's answer for a sandbox that is gone; its SDK recognises "was not found".
            raise Refused(502, "SandboxGone", str(exc)) from None
        except REFUSALS as exc:  # there, asleep, and its key may not wake it now: said why
            raise Refused(exc.status, type(exc).__name__, str(exc)) from None

    async def _signed_file(self, request: Request) -> SignedFile | None:
        """The sandbox a signed file URL opens (kept in the request's state for the route),
        None when the URL carries no signature. Refused: malformed, expired, or signed by no
        sandbox's token (counted as a wrong key: 429 once its client guesses too many)."""
        assert self.sandboxes is not None
        try:
            asked = SignedFileRequest.of(request)
        except SignedUrlRefused as exc:
            raise Refused(exc.status, "SignedUrlRefused", str(exc)) from None
        if asked is None:
            return None
        client = client_address(request)
        throttle = self.authenticate.throttle
        try:
            throttle.before_check(client, asked.signature)
        except TooManyWrongKeys as refused:
            raise WrongKeysThrottled(refused) from None
        record = await self.sandboxes.signed_by(
            asked.signed_with, asked.named_sandbox, asked.host_sandbox
        )
        if record is None or record.token is None:  # (a record found has a token)
            throttle.failed(client, asked.signature)
            raise Refused(
                401,
                "SignedUrlRefused",
                "the URL's signature opens no sandbox: it was signed for another path, "
                "operation or user, or its sandbox is gone; ask for a new URL",
            )
        signed = SignedFile(record.sandbox_id, record.token)
        request.state.signed_file = signed
        return signed

    async def _read_unchecked(self, request: Request, receive: Receive) -> tuple[bytes, bool]:
        """The body of a request no key was checked for: at most UNCHECKED_BODY_MAX bytes of
        any type (413 past it), measured if a parser reads it as JSON."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > UNCHECKED_BODY_MAX:
            raise _unchecked_too_large()
        body, more = await _read_body(receive, UNCHECKED_BODY_MAX)
        if _read_as_json(request):
            await self._check_depth(body)
        return body, more

    def _measured_envelopes(self, receive: Receive) -> Receive:
        """A receive that passes a Connect stream's body on as it comes, each envelope (5-byte
        header: flags, big-endian length; then the message) only once whole and measured. Only
        the envelope not yet whole is held, at most _MAX_STREAMED_MESSAGE. What came before a
        refused message is delivered; the refusal comes next, as the stream's error."""
        pending = bytearray()
        failure: ConnectError | None = None

        async def measured() -> Message:
            nonlocal failure
            if failure is not None:
                raise failure
            message = await receive()
            if message["type"] != "http.request":
                return message
            pending.extend(message.get("body", b""))
            passed = bytearray()
            while len(pending) >= _ENVELOPE_HEADER and failure is None:
                size = int.from_bytes(pending[1:_ENVELOPE_HEADER], "big")
                if size > _MAX_STREAMED_MESSAGE:
                    failure = ConnectError(
                        Code.RESOURCE_EXHAUSTED,
                        f"a message of {size} bytes is over the limit of "
                        f"{_MAX_STREAMED_MESSAGE}; send input in smaller pieces",
                    )
                    break
                if len(pending) < _ENVELOPE_HEADER + size:
                    break
                envelope = bytes(pending[: _ENVELOPE_HEADER + size])
                try:
                    await self._check_depth(envelope[_ENVELOPE_HEADER:])
                except Refused as refused:
                    failure = ConnectError(Code.INVALID_ARGUMENT, str(refused))
                    break
                passed += envelope
                del pending[: _ENVELOPE_HEADER + size]
            if failure is not None and not passed:
                raise failure
            more = bool(message.get("more_body", False))
            if not more and failure is None:  # a truncated last envelope: the app says so
                passed += pending
                pending.clear()
            return {
                "type": "http.request",
                "body": bytes(passed),
                "more_body": more or failure is not None,
            }

        return measured

    async def _check_depth(self, body: bytes) -> None:
        limit = self.max_json_depth
        if len(body) > _MEASURE_IN_A_THREAD:
            too_deep = await anyio.to_thread.run_sync(nests_deeper_than, body, limit)
        else:
            too_deep = nests_deeper_than(body, limit)
        if too_deep:
            raise Refused(
                400,
                "JsonTooDeep",
                f"the JSON body is nested deeper than {limit} levels of arrays and objects; "
                "flatten it (or send the data as a string or a file)",
            )


def _is_client_stream(path: str) -> bool:
    return _e2b_path(path) in _CLIENT_STREAMS


def _api_key(request: Request) -> str:
    """The key E2B's SDK sends (`X-API-Key`), or a bearer key."""
    key = request.headers.get("x-api-key", "")
    if not key:
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        key = bearer if scheme.lower() == "bearer" else ""
    return key


def _refuse_compressed(request: Request) -> None:
    """Connect would inflate a compressed body before its parser reads it, past our measure;
    E2B's SDK never compresses its Connect requests."""
    for header in ("content-encoding", "connect-content-encoding", "grpc-encoding"):
        encoding = request.headers.get(header, "identity").strip().lower()
        if encoding != "identity":
            raise Refused(
                400,
                "CompressionNotAccepted",
                f"{header}: {encoding} is not accepted here; send the message uncompressed",
            )


def _read_as_json(request: Request) -> bool:
    """Whether some parser of the app reads this body as JSON: FastAPI does with no content
    type or a JSON one; Connect with `application/json` or `application/connect+json`."""
    if request.method in ("GET", "HEAD", "OPTIONS"):
        return False
    content_type = request.headers.get("content-type")
    if not content_type:  # FastAPI reads such a body as JSON; an upload route never does
        path = get_route_path(request.scope)
        # Raw bodies with no type: an upload's, a process's input.
        uploaded = is_upload(request.method, path)
        return not (uploaded or (request.method == "POST" and _STDIN.fullmatch(path)))
    return _names_json(content_type)


@functools.lru_cache(maxsize=256)  # a few types come again and again; parsed once each
def _names_json(content_type: str) -> bool:
    parsed = email.message.Message()
    parsed["content-type"] = content_type
    subtype = parsed.get_content_subtype()
    return parsed.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def _read_body(receive: Receive, limit: int | None = None) -> tuple[bytes, bool]:
    """The whole body (the size limit outside this gate bounds it, or `limit`: past it, 413)
    and whether the client left before its end."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left
            return b"".join(chunks), True
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise _unchecked_too_large()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _unchecked_too_large() -> Refused:
    return Refused(
        413,
        "TooLarge",
        f"a request body here is at most {UNCHECKED_BODY_MAX} bytes: no key is checked before "
        "it is read (public pages, the console's forms, unknown paths); send large bodies to "
        "the keyed API",
        {"Connection": "close"},
    )


def _replay(body: bytes, disconnected: bool, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the client's own messages."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if disconnected:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _answer(send: Send, family: Family, refused: Refused) -> None:
    METRICS.errors.labels(refused.kind).inc()
    status, message = refused.status, str(refused)
    headers = [(b"content-type", b"application/json")]
    if family is Family.CONNECT:
        # Connect has no 502: a sandbox that is gone is "unavailable", as E2B's envd says.
        status = 503 if status == 502 else status
        payload: dict[str, object] = {"code": _CONNECT_CODES[status], "message": message}
    elif family in (Family.E2B_CONTROL, Family.E2B_DATA, Family.E2B_VOLUME):
        payload = {"code": status, "message": message}
        headers.append((b"should-retry", b"false"))
    else:
        payload = {"error": {"type": refused.kind, "message": message}}
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    named = {name for name, _ in headers}
    headers += [
        (name.lower().encode(), value.encode())
        for name, value in refused.headers.items()
        if name.lower().encode() not in named
    ]
    body = json.dumps(payload).encode()
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
