"""Who a request to a session's port comes from, and the headers that go on to its server.

The service's own credentials never reach a sandbox: on these routes our API key is taken only
from `X-API-Key` (`Authorization` belongs to the app in the sandbox, which may have its own
logins, and goes on untouched), the port token from `X-Port-Token` or E2B's
`E2B-Traffic-Access-Token`; all three are removed before the request goes on.
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from code_interpreter_wire.ports import E2B_TRAFFIC_TOKEN_HEADER, PORT_TOKEN_HEADER
from orchestrator.auth import Authenticator, client_address
from orchestrator.service_parts.ports import PortCaller

API_KEY_HEADER = "x-api-key"
# Ours, never the server's: our key, the port token, E2B's tokens and sandbox header.
CREDENTIAL_HEADERS = frozenset(
    {
        API_KEY_HEADER,
        PORT_TOKEN_HEADER,
        E2B_TRAFFIC_TOKEN_HEADER,
        "x-access-token",
        "e2b-sandbox-id",
    }
)
# Set by the service itself for the server; a client's own would be taken for the service's.
FORWARDING_HEADERS = frozenset(
    {"forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-forwarded-prefix"}
)
# Of one connection only (RFC 9110 7.6.1), never relayed; with those `Connection` names.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def port_caller(
    connection: HTTPConnection, authenticate: Authenticator, *, path_form: bool
) -> PortCaller:
    """The caller of a port request: a key sent in X-API-Key (or, on the path form, which is
    our API's URL space, as `Authorization: Bearer`) is checked as any key is (a wrong one is
    a 401, counted against its client like any wrong key); the token is the service's to
    compare."""
    client = client_address(connection)
    key = connection.headers.get(API_KEY_HEADER)
    if not key and path_form:
        scheme, _, bearer = connection.headers.get("authorization", "").partition(" ")
        key = bearer.strip() if scheme.lower() == "bearer" else None
    owner: str | None = None
    if authenticate.disabled:
        owner = authenticate.owner_for_key("")
    elif key:
        owner = authenticate.owner_for_key(key, client)  # 401 / 429 as for any key
    token = connection.headers.get(PORT_TOKEN_HEADER) or connection.headers.get(
        E2B_TRAFFIC_TOKEN_HEADER
    )
    return PortCaller(owner=owner, token=token or None, client=client)


def onward_headers(connection: HTTPConnection, *, path_form: bool) -> list[tuple[bytes, bytes]]:
    """The request's headers as its server gets them: none of ours (on the path form, where
    `Authorization` is our API's, not that either), none of one hop, no forwarding claims."""
    named = {
        name.strip().lower()
        for value in connection.headers.getlist("connection")
        for name in value.split(",")
    }
    dropped = HOP_BY_HOP | CREDENTIAL_HEADERS | FORWARDING_HEADERS | named
    if path_form:
        dropped |= {"authorization"}
    return [
        (name, value)
        for name, value in connection.scope["headers"]
        if name.decode("latin-1").lower() not in dropped
    ]
