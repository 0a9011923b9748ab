"""Noticing placeholders in a stream the proxy relays unchanged: what a session with secrets
sends over HTTPS to a host none of them is bound to (the proxy inspects that TLS,
sandbox/egress/exchange.py), so the attempt is recorded even though nothing is swapped.

Why a stream scanner rather than an HTTP parser: the bytes go on as they are, whatever protocol
runs inside the tunnel, and a placeholder anywhere (a header, a URL, a body) is worth noting.
Memory stays bounded: a tail shorter than the longest placeholder is kept between chunks, and
at most MAX_NAMES distinct names are remembered.
"""

from __future__ import annotations

import re

from code_interpreter_wire.secrets import PLACEHOLDER_PREFIX, SECRET_NAME

_PLACEHOLDER = re.compile(
    re.escape(PLACEHOLDER_PREFIX.encode()) + rb"(" + SECRET_NAME.encode() + rb")"
)
_NAME_BYTE = re.compile(rb"[A-Za-z0-9_]")
# The longest placeholder and the byte after it (a name running on is not the name).
_WINDOW = len(PLACEHOLDER_PREFIX) + 64 + 1
MAX_NAMES = 32  # more than the outcomes a record lists (credentials.MAX_OUTCOMES)


class PlaceholderScanner:
    """The placeholder names seen in the chunks fed to it, in the order first seen."""

    def __init__(self) -> None:
        self._tail = b""
        self._names: dict[str, None] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._names)

    def feed(self, chunk: bytes) -> None:
        """Scan `chunk`, continuing what earlier chunks began. A placeholder at the very end is
        left for the next chunk (or `close`) to tell whether its name goes on."""
        data = self._tail + chunk
        self._scan(data, final=False)
        self._tail = data[-_WINDOW:]

    def close(self) -> None:
        """The stream ended: what the tail holds counts as it is."""
        self._scan(self._tail, final=True)
        self._tail = b""

    def _scan(self, data: bytes, *, final: bool) -> None:
        if PLACEHOLDER_PREFIX.encode()[:4] not in data:
            return
        for match in _PLACEHOLDER.finditer(data):
            end = match.end()
            if end == len(data) and not final:
                continue  # the name may go on in the next chunk; the tail keeps it
            if end < len(data) and _NAME_BYTE.fullmatch(data[end : end + 1]):
                continue  # longer than a name may be: not a placeholder
            if len(self._names) < MAX_NAMES:
                self._names.setdefault(match.group(1).decode("ascii"), None)
