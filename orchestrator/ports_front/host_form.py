"""E2B's scheme for a sandbox's ports: `<port>-<session id>.<domain>` (what E2B's `get_host`
gives), routed as the path form `/v1/sessions/{id}/ports/{port}` with the client's own path.

Outermost of the service's middleware, so the request gate and the app see the path form. The
ports E2B's own SDK talks to a sandbox on (envd's 49983, the code interpreter's 49999) are left
to the E2B front, told the sandbox the host names when the SDK sends no E2b-Sandbox-Id header
(E2B's v1 SDK never does). With a `ports_domain` only hosts under it are taken; without one, any
host of that shape is (the service has no other names of that shape)."""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from orchestrator.ports_front.routes import HOST_FORM, ORIGINAL_PATH, PATH

# A session's id is `s-` and hex (orchestrator/sessions.py): a host of another shape (a proxy's
# own `8000-workspace.example.io`) is no session's.
_PORT_HOST = re.compile(r"^([0-9]{1,5})-(s-[a-z0-9]{1,120})\.(.+)$")
E2B_OWN_PORTS = frozenset({49983, 49999})


class PortHosts:
    def __init__(self, app: ASGIApp, *, domain: str | None) -> None:
        self.app = app
        self.domain = domain.lower() if domain else None

    def route(self, scope: Scope) -> tuple[str, int] | None:
        """(session id, port) a request's Host names, or None."""
        host = next((v for k, v in scope.get("headers", ()) if k == b"host"), b"")
        found = _PORT_HOST.match(host.decode("latin-1").lower())
        if found is None:
            return None
        port = int(found[1])
        if port in E2B_OWN_PORTS or (self.domain is not None and found[3] != self.domain):
            return None
        return found[2], port

    def e2b_sandbox(self, scope: Scope) -> str | None:
        """The sandbox an E2B SDK names only by host (`49983-<id>.<domain>`: E2B's v1 SDK,
        or v2 told no sandbox URL), where it sends no E2b-Sandbox-Id; None otherwise."""
        headers = scope.get("headers", ())
        if any(k == b"e2b-sandbox-id" for k, _ in headers):
            return None
        host = next((v for k, v in headers if k == b"host"), b"")
        found = _PORT_HOST.match(host.decode("latin-1").lower())
        if found is None or int(found[1]) not in E2B_OWN_PORTS:
            return None
        if self.domain is not None and found[3] != self.domain:
            return None
        return found[2]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            named = self.e2b_sandbox(scope)
            if named is not None:  # said as the header the E2B front reads
                scope = {
                    **scope,
                    "headers": [*scope["headers"], (b"e2b-sandbox-id", named.encode())],
                }
            routed = self.route(scope)
            if routed is not None:
                session_id, port = routed
                prefix = PATH.format(session_id=session_id, port=port)
                path = scope["path"] if scope["path"].startswith("/") else "/" + scope["path"]
                raw = scope.get("raw_path") or path.encode()
                scope = {
                    **scope,
                    "path": prefix + path,
                    "raw_path": prefix.encode() + raw,
                    HOST_FORM: True,
                    ORIGINAL_PATH: raw,
                }
        await self.app(scope, receive, send)
