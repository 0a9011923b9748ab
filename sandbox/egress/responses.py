"""The proxy's own answers: raw HTTP/1.1 bytes, so they can be sent whatever state the request
parser is in (after a protocol error, before reading anything)."""

from __future__ import annotations

import re

_REASON_CHARS = 200
_UNSAFE = re.compile(r"[^\x20-\x7e]")
_TITLES = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
}

CONNECT_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


def reason_phrase(text: str) -> str:
    """A status line's reason: printable ASCII only, capped. Clients such as pip, requests and
    urllib show only this for a refused CONNECT, so it carries the short reason."""
    phrase = _UNSAFE.sub("?", text)
    if len(phrase) > _REASON_CHARS:
        phrase = phrase[: _REASON_CHARS - 3] + "..."
    return phrase


def answer(status: int, reason: str, body: str) -> bytes:
    """A complete response that closes the connection, with a text body for reading."""
    payload = body.encode("utf-8", "replace")
    phrase = reason_phrase(reason) or _TITLES.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(payload)}\r\n"
        "Connection: close\r\n"
        "Proxy-Connection: close\r\n"
        "\r\n"
    )
    return head.encode("ascii") + payload


def refusal(reason: str, policy_text: str) -> bytes:
    """The 403 for a destination the policy does not allow: why, the policy, and what to do."""
    body = (
        f"egress refused: {reason}\n"
        f"This sandbox's network policy: {policy_text}.\n"
        "If the sandbox needs this destination, ask the operator to allow it.\n"
    )
    return answer(403, f"egress refused: {reason}", body)
