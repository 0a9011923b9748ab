"""The console's answers carry a strict Content-Security-Policy (this origin only: no inline
script or style, no frames), are never framed, and pages are never cached (they show what a key
may see)."""

from __future__ import annotations

from starlette._utils import get_route_path
from starlette.types import Scope

from orchestrator.security_headers import Headers, ResponseHeaders

# Pico's own icons are data: URIs in its CSS, hence img-src data:.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_ALWAYS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make form POSTs say Origin: null
    (b"cross-origin-opener-policy", b"same-origin"),
]
_NOT_STORED = (b"cache-control", b"no-store")


class ConsoleHeaders(ResponseHeaders):
    def headers_for(self, scope: Scope, headers: Headers) -> Headers:
        given = {name.lower() for name, _ in headers}
        # A route's own (stricter: an image a sandbox made) is kept.
        headers = [*headers, *(h for h in _ALWAYS if h[0] not in given)]
        static = get_route_path(scope).startswith("/static/")
        if not static and b"cache-control" not in given:
            headers.append(_NOT_STORED)
        return headers
