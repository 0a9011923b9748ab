"""What a session's egress proxy recorded, kept for whoever reports it elsewhere: when the proxy
runs beside a sandbox on another machine (a Ray node), its records wait here until a service
replica takes them (a long poll), for the service's log, metrics and audit.

Bounded: at most `MAX_UNTAKEN` records wait; past that a new record is dropped and counted, and
the count goes out with the next batch, so the service can say records were lost. A poll takes
at most `RECORDS_PER_POLL` records and waits at most `MAX_POLL_S`; each record is given to one
poller only (at most once, as the audit log's in-memory queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from dataclasses import dataclass

from code_interpreter_wire.errors import SandboxClosed
from sandbox.egress.ledger import MAX_METHOD_CHARS, EgressLedger, EgressRecord, EgressTotals

MAX_UNTAKEN = 4096  # records of one session waiting for a replica
RECORDS_PER_POLL = 256  # at most this many in one answer of `next_egress_records`
MAX_POLL_S = 30.0  # the longest a poll waits: a replica gone leaves no poll waiting long
MAX_REASON_CHARS = 1024  # a record's reason, as it travels
MAX_HOST_CHARS = 255  # its host (a DNS name is at most 253)


@dataclass(frozen=True)
class EgressBatch:
    """What one poll takes: records, oldest first, and how many were dropped (the outbox was
    full) since the last batch that said so."""

    records: tuple[EgressRecord, ...]
    dropped: int = 0


class EgressOutbox:
    """The records of one session's proxy not taken by a replica yet."""

    def __init__(self, capacity: int = MAX_UNTAKEN) -> None:
        self.capacity = capacity
        self._records: deque[EgressRecord] = deque()
        self._dropped = 0
        self._added = asyncio.Event()
        self._taken = asyncio.Event()
        self.closed = False

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: EgressRecord) -> None:
        """Keep a record (never blocks: the proxy calls this as a connection ends)."""
        if len(self._records) >= self.capacity:
            self._dropped += 1
            return
        if (
            len(record.reason) > MAX_REASON_CHARS
            or len(record.host) > MAX_HOST_CHARS
            or len(record.method) > MAX_METHOD_CHARS
        ):
            record = dataclasses.replace(
                record,
                reason=_cut(record.reason, MAX_REASON_CHARS),
                host=_cut(record.host, MAX_HOST_CHARS),
                method=record.method[:MAX_METHOD_CHARS],
            )
        self._records.append(record)
        self._added.set()

    async def take(self, max_wait_s: float) -> EgressBatch:
        """Records not taken yet (at most RECORDS_PER_POLL), waiting up to `max_wait_s` (at
        most MAX_POLL_S) for one; an empty batch if none came. Once closed and emptied: a
        SandboxError, so that pollers stop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(max_wait_s, 0.0), MAX_POLL_S)
        while not self._records and not self._dropped:
            if self.closed:
                raise SandboxClosed("the session's egress proxy is closed")
            self._added.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return EgressBatch(())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._added.wait(), remaining)
        count = min(len(self._records), RECORDS_PER_POLL)
        batch = EgressBatch(tuple(self._records.popleft() for _ in range(count)), self._dropped)
        self._dropped = 0
        if not self._records:
            self._taken.set()
        return batch

    def close(self) -> None:
        """No more records come; pollers waiting are woken (they take what is left)."""
        self.closed = True
        self._added.set()

    async def drained(self, within_s: float) -> bool:
        """Whether every record was taken within `within_s`."""
        if not self._records:
            return True
        self._taken.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._taken.wait(), within_s)
        return not self._records

    def leftovers(self) -> tuple[list[EgressRecord], int]:
        """What no poller took, and the drops not reported; emptied."""
        left, dropped = list(self._records), self._dropped
        self._records.clear()
        self._dropped = 0
        return left, dropped


@dataclass(frozen=True)
class EgressReport:
    """A proxy's running totals and its latest records (what a session's network report shows)."""

    totals: EgressTotals
    records: tuple[EgressRecord, ...]

    @classmethod
    def of(cls, ledger: EgressLedger, most: int) -> EgressReport:
        latest = tuple(ledger.records)[-most:] if most > 0 else ()
        return cls(dataclasses.replace(ledger.totals), latest)


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."
