"""Counting bytes against the session's cap while they flow, and noticing idleness.

Why grant before forwarding: the cap is exact (a chunk that would cross it is cut at the cap),
and a connection past it ends at once rather than one chunk later."""

from __future__ import annotations

import asyncio

from sandbox.egress.ledger import EgressLedger


class CapReached(Exception):
    """The session's egress byte cap is used up: every open connection of it ends."""


class ByteBudget:
    """The session's cap on bytes up + down, kept in its ledger."""

    def __init__(self, ledger: EgressLedger, cap: int) -> None:
        self.ledger = ledger
        self.cap = cap

    @property
    def exhausted(self) -> bool:
        return self.ledger.bytes_used >= self.cap

    def grant(self, wanted: int, *, up: bool) -> int:
        """How many of `wanted` bytes may go (all, some or none), counted as gone."""
        granted = max(0, min(wanted, self.cap - self.ledger.bytes_used))
        if up:
            self.ledger.count(up=granted)
        else:
            self.ledger.count(down=granted)
        return granted


class Meter:
    """One connection's bytes and last activity."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.up = 0
        self.down = 0
        self.last_activity = asyncio.get_running_loop().time()

    def take(self, data: bytes, *, up: bool) -> bytes:
        """The part of `data` the cap lets through, counted; `CapReached` after a cut one is
        sent is the caller's to raise (see `cut`)."""
        granted = self.budget.grant(len(data), up=up)
        if up:
            self.up += granted
        else:
            self.down += granted
        self.touch()
        return data[:granted]

    def touch(self) -> None:
        self.last_activity = asyncio.get_running_loop().time()

    def idle_for(self) -> float:
        return asyncio.get_running_loop().time() - self.last_activity
