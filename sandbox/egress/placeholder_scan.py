"""Noticing placeholders in a stream the proxy relays unchanged: what a session with secrets
sends over HTTPS to a host none of them is bound to (the proxy inspects that TLS,
sandbox/egress/exchange.py), so the attempt is recorded even though nothing is swapped.

Why a stream scanner rather than an HTTP parser: the bytes go on as they are, whatever protocol
runs inside the tunnel, and a placeholder anywhere (a header, a URL, a body) is worth noting: as
written, percent-encoded (`cir-secret%3A%2F%2FNAME`, as a query string or form carries it;
`cir-secret%3A//NAME`, as a path does) or JSON-escaped (`cir-secret:\\/\\/NAME`). Not
recognized: other encodings (base64 as in Basic auth, compression) and a placeholder cut by the
transfer's own framing (a chunked body's chunk boundary). Memory stays bounded: a tail shorter
than the longest placeholder is kept between chunks; the session's own names are always noted,
at most MAX_UNKNOWN made-up ones (more are summed up), so a flood of made-up names cannot hide a
real one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from code_interpreter_wire.secrets import PLACEHOLDER_PREFIX, SECRET_NAME

_SCHEME = PLACEHOLDER_PREFIX.removesuffix("://").encode()  # b"cir-secret"
# As written, percent-encoded (whole, or as `quote()` leaves a path's slashes), JSON-escaped.
_SEPARATORS = (rb"://", rb"%3a%2f%2f", rb"%3a//", rb":\/\/")
_PLACEHOLDER = re.compile(
    re.escape(_SCHEME)
    + rb"(?i:"
    + b"|".join(re.escape(s) for s in _SEPARATORS)
    + rb")("
    + SECRET_NAME.encode()
    + rb")"
)
_NAME_BYTE = re.compile(rb"[A-Za-z0-9_]")
_LONGEST_NAME = 64  # SECRET_NAME's
# The longest placeholder and the byte after it (a name running on is not the name).
_WINDOW = len(_SCHEME) + max(len(s) for s in _SEPARATORS) + _LONGEST_NAME + 1
MAX_UNKNOWN = 16  # made-up names remembered by name; more are counted only


class PlaceholderScanner:
    """The placeholder names seen in the chunks fed to it: the session's own (`known`) and up
    to MAX_UNKNOWN others, each in the order first seen, and how many others there were."""

    def __init__(self, known: Iterable[str]) -> None:
        self._known = frozenset(known)
        self._tail = b""
        self._names: dict[str, None] = {}
        self._unknown: dict[str, None] = {}
        self.unknown_beyond = 0  # placeholders of made-up names past MAX_UNKNOWN's

    @property
    def names(self) -> tuple[str, ...]:
        """The session's names seen, then the made-up ones remembered."""
        return (*self._names, *self._unknown)

    def feed(self, chunk: bytes) -> None:
        """Scan `chunk`, continuing what earlier chunks began. A placeholder at the very end is
        left for the next chunk (or `close`) to tell whether its name goes on."""
        data = self._tail + chunk
        self._scan(data, seen=len(self._tail), final=False)
        self._tail = data[-_WINDOW:]

    def close(self) -> None:
        """The stream ended: what the tail holds counts as it is."""
        self._scan(self._tail, seen=len(self._tail), final=True)
        self._tail = b""

    def _scan(self, data: bytes, *, seen: int, final: bool) -> None:
        """`seen`: the bytes at the start of `data` scanned already (the tail kept): a match
        ending there, the byte after it in them too, was told apart before."""
        if _SCHEME not in data:
            return
        for match in _PLACEHOLDER.finditer(data):
            end = match.end()
            if end < seen:
                continue
            if end == len(data) and not final:
                continue  # the name may go on in the next chunk; the tail keeps it
            if end < len(data) and _NAME_BYTE.fullmatch(data[end : end + 1]):
                continue  # longer than a name may be: not a placeholder
            name = match.group(1).decode("ascii")
            if name in self._known:
                self._names.setdefault(name, None)
            elif name in self._unknown:
                continue
            elif len(self._unknown) < MAX_UNKNOWN:
                self._unknown[name] = None
            else:
                self.unknown_beyond += 1
