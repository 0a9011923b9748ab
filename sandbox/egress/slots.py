"""Connections open at once through several session proxies together: one key's sessions (so
one key cannot hold everyone's share), and every session's (each connection holds two of the
service's descriptors, one pool for the API and every session).

On one machine a count in the service's process holds them (`ConnectionSlots`); where the
proxies run on several machines (Ray nodes) they ask one count the cluster shares
(sandbox/backends/ray_cluster/egress_counter.py). Either way the proxy takes a slot of each
before it serves a connection and gives them back as it ends (`Slots`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

FULL = "too many connections"  # a cap reached: the 503's reason
UNCHECKED = "connection caps unchecked"  # the caps could not be checked: the 503's reason


@dataclass(frozen=True)
class Refusal:
    """Why a connection is not served now: the 503's reason (`FULL`, or what failed) and the
    text that says whose cap it was (or what failed) and what to do."""

    reason: str
    text: str


class Slots(Protocol):
    async def take(self) -> Refusal | None:
        """One more connection: None if there was room (a slot is then held), else why not."""
        ...

    def give_back(self) -> None:
        """A connection that held a slot ended."""
        ...


@dataclass(frozen=True)
class SharedCaps:
    """The caps a session's connections share with others': its key's
    (`egress_max_connections_per_key`, `owner` the key's owner) and the service's
    (`egress_max_connections_total`)."""

    owner: str
    per_key: int
    total: int

    def __post_init__(self) -> None:
        if self.per_key < 1 or self.total < 1:
            raise ValueError("the connection limits must be positive")
        if not self.owner:
            raise ValueError("shared caps need the key's owner")

    def key_full(self) -> Refusal:
        return Refusal(FULL, key_full(self.per_key))

    def total_full(self) -> Refusal:
        return Refusal(FULL, total_full(self.total))


def key_full(cap: int) -> str:
    return (
        f"this API key's sessions already have {cap} connections open through their "
        "proxies, the key's cap (egress_max_connections_per_key); close some in this key's "
        "sessions and retry, or ask the operator to raise the cap"
    )


def total_full(cap: int) -> str:
    return (
        f"the service's egress proxies hold {cap} connections, the service's cap "
        "(egress_max_connections_total) shared by every key; retry later"
    )


class ConnectionSlots:
    """A count with a ceiling in this process, taken and given back on the event loop (no
    lock needed). `when_full` is what a refused connection is told."""

    def __init__(self, limit: int, when_full: str) -> None:
        if limit < 1:
            raise ValueError("the connection limit must be positive")
        self.limit = limit
        self.when_full = when_full
        self.taken = 0

    async def take(self) -> Refusal | None:
        if self.taken >= self.limit:
            return Refusal(FULL, self.when_full)
        self.taken += 1
        return None

    def give_back(self) -> None:
        self.taken = max(0, self.taken - 1)
