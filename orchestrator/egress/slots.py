"""Connections open at once through every session's proxy together: each holds two of the
service's descriptors (the sandbox's side and the destination's), and those are one pool for
the API and every session, so the sum is capped as well as each session's share."""

from __future__ import annotations


class ConnectionSlots:
    """A count with a ceiling, taken and given back on the event loop (no lock needed)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the connection limit must be positive")
        self.limit = limit
        self.taken = 0

    def take(self) -> bool:
        """One more connection, if there is room."""
        if self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def give_back(self) -> None:
        self.taken = max(0, self.taken - 1)
