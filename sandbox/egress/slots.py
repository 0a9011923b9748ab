"""Connections open at once through several session proxies together: one key's sessions (so
one key cannot hold everyone's share), and every session's (each connection holds two of the
service's descriptors, one pool for the API and every session)."""

from __future__ import annotations


class ConnectionSlots:
    """A count with a ceiling, taken and given back on the event loop (no lock needed).
    `when_full` is what a refused connection is told: whose cap it was and what to do."""

    def __init__(self, limit: int, when_full: str) -> None:
        if limit < 1:
            raise ValueError("the connection limit must be positive")
        self.limit = limit
        self.when_full = when_full
        self.taken = 0

    def take(self) -> bool:
        """One more connection, if there is room."""
        if self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def give_back(self) -> None:
        self.taken = max(0, self.taken - 1)
