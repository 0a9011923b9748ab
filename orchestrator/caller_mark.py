"""How the HTTP server learns that a request's caller proved who they are.

The connection guard (orchestrator/connection_guard.py) may close a connection whose caller has
not shown a key whatever it is doing, but never a keyed one that is being served; only the app
knows when a key checked out. So the server puts a mark in each request's ASGI scope (under
`extensions`) and whatever checks the caller (orchestrator/request_guard.py, the terminal's
WebSocket) sets it: the server reads it, it never trusts a path for it."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

EXTENSION = "code_interpreter.caller"


class CallerMark:
    """One request's: whether its caller is proven, and whether its body is a stream of
    messages sent as they come (E2B's StreamInput), exempt from the minimum body rate."""

    __slots__ = ("_on_proven", "proven", "streams_body")

    def __init__(self, on_proven: Callable[[], None]) -> None:
        self._on_proven = on_proven
        self.proven = False
        self.streams_body = False

    def prove(self, *, streams_body: bool) -> None:
        self.streams_body = streams_body
        if not self.proven:
            self.proven = True
            self._on_proven()


def attach(scope: MutableMapping[str, Any], mark: CallerMark) -> None:
    """Put `mark` in the scope the app will be called with."""
    extensions = scope.get("extensions")
    if extensions is None:
        extensions = scope["extensions"] = {}
    extensions[EXTENSION] = {"mark": mark}


def caller_proven(scope: MutableMapping[str, Any], *, streams_body: bool = False) -> None:
    """The request's caller showed a key that checked out (`streams_body`: and its body is a
    client stream that was authenticated as one). No mark (another server, a test client): a
    no-op."""
    entry = (scope.get("extensions") or {}).get(EXTENSION)
    if entry is not None:
        entry["mark"].prove(streams_body=streams_body)
