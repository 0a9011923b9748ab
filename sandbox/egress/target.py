"""Where a proxy request wants to go: the host and port of `CONNECT host:port` or of an
absolute-form URL (`GET http://host:port/path`), and whether its `Host` header agrees."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from code_interpreter_wire.network_policy import PolicyError, normalize_host


class BadTarget(Exception):
    """A request the proxy cannot route; the message says what to send instead."""


@dataclass(frozen=True)
class Target:
    host: str  # normalized (code_interpreter_wire.network_policy.normalize_host)
    port: int
    path: str  # origin-form for the upstream request line; "" for CONNECT


def split_authority(text: str) -> tuple[str, int | None]:
    """`host`, `host:port` or `[v6]:port` into the host and the port (None when absent)."""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadTarget(f"{text[:80]!r}: an IPv6 address needs its closing ']'")
        host, rest = text[: end + 1], text[end + 1 :]
        if rest and not rest.startswith(":"):
            raise BadTarget(f"{text[:80]!r}: only ':port' may follow ']'")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise BadTarget(f"{text[:80]!r}: write an IPv6 address in brackets, e.g. [2001:db8::1]:443")
    else:
        host, port_text = text, None
    if port_text is None:
        return _host(host), None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise BadTarget(f"{text[:80]!r}: the port must be a number from 1 to 65535")
    return _host(host), int(port_text)


def _host(text: str) -> str:
    try:
        return normalize_host(text)
    except PolicyError as exc:
        raise BadTarget(str(exc)) from None


def parse_connect(raw: bytes) -> Target:
    """The target of a CONNECT request: `host:port`, the port required."""
    host, port = split_authority(_text(raw))
    if port is None:
        raise BadTarget("CONNECT needs a port: CONNECT host:443")
    return Target(host, port, "")


def parse_absolute(raw: bytes) -> Target:
    """The target of a plain-HTTP proxy request, which must be an absolute `http://` URL."""
    text = _text(raw)
    if text.startswith("/") or text == "*":
        raise BadTarget(
            "this is an HTTP proxy: send the absolute URL (GET http://host/path HTTP/1.1), or "
            "CONNECT host:port for TLS; set HTTP_PROXY/HTTPS_PROXY rather than calling the "
            "proxy as a server"
        )
    parts = urlsplit(text)
    if parts.scheme.lower() != "http":
        raise BadTarget(
            f"{text[:80]!r}: only http:// URLs are forwarded as requests; https goes through "
            "CONNECT host:443, which clients do when HTTPS_PROXY is set"
        )
    if "@" in parts.netloc:
        raise BadTarget("user names or passwords in the URL are not forwarded; send a header")
    if not parts.netloc:
        raise BadTarget(f"{text[:80]!r} has no host")
    host, port = split_authority(parts.netloc)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(host, port or 80, path)


def host_header_mismatch(header: bytes, target: Target, default_port: int) -> str | None:
    """Why a `Host` header disagrees with the target, or None when it names the same place."""
    try:
        host, port = split_authority(_text(header))
    except BadTarget as exc:
        return f"the Host header is not a host: {exc}"
    if host != target.host or (port or default_port) != target.port:
        shown = header.decode("ascii", "replace")[:80]
        return (
            f"the Host header {shown!r} does not match the request's destination "
            f"{target.host}:{target.port}"
        )
    return None


def _text(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise BadTarget("the request target must be ASCII (IDNA for international names)") from None
