"""The session actor's end of its sandbox's egress: the proxy (sandbox/egress/) runs in the actor,
on the node, on the egress socket the node's backend made for the sandbox; what it records of
each connection waits in a bounded outbox until a service replica takes it, for the service's
log, metrics and audit.

Why on the node: the sandbox's socket is there and its connections leave from there; a replica
may be on any machine, or none may be connected for a while. So the decisions are made where
the sandbox is, with the policy the actor was made with and the ceiling and settings the
replica hands over (`open_egress`), and only the records travel, taken with a long poll
(`next_egress_records`, as the tool relay's calls are).

Bounded: at most `MAX_UNTAKEN` records wait; past that a new record is dropped and counted, and
the count goes out with the next batch, so the service can say records were lost. A poll takes
at most `RECORDS_PER_POLL` records and waits at most `MAX_POLL_S`; each record is given to one
poller only (at most once, as the audit log's in-memory queue). The per-session caps
(connections open at once, bytes) hold exactly as on one machine, in the proxy itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.descriptors import raise_descriptor_limit
from sandbox.egress import EgressLedger, EgressProxy, EgressRecord, EgressSettings, EgressTotals

if TYPE_CHECKING:
    from sandbox.backends.base import Sandbox

log = logging.getLogger(__name__)

MAX_UNTAKEN = 4096  # records of one session waiting for a replica
RECORDS_PER_POLL = 256  # at most this many in one answer of `next_egress_records`
MAX_POLL_S = 30.0  # the longest a poll waits: a replica gone leaves no poll waiting long
MAX_REASON_CHARS = 1024  # a record's reason, as it travels
DRAIN_S = 2.0  # at close, how long the records left wait for a poller before being logged here


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
        if len(record.reason) > MAX_REASON_CHARS:
            record = dataclasses.replace(record, reason=record.reason[:MAX_REASON_CHARS] + "...")
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
                raise SandboxError("the session's egress proxy is closed")
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


class NodeEgress:
    """Mixin of the session actor: its sandbox's egress proxy and the records it keeps for the
    service. Its calls are not counted as the session's activity: replicas poll all the time."""

    _egress_proxy: EgressProxy | None = None
    _egress_ledger: EgressLedger | None = None
    _egress_outbox: EgressOutbox | None = None

    if TYPE_CHECKING:  # given by the actor this is mixed into
        sandbox: Sandbox
        sandbox_id: str

    async def open_egress(self, ceiling: NetworkPolicy, settings: EgressSettings) -> bool:
        """Start the sandbox's proxy with its own policy, the service's `ceiling` and
        `settings`, if its sandbox has an egress socket; whether a proxy runs. Again: nothing
        changes (the first ceiling and settings hold). No socket, no proxy: the sandbox has no
        way out at all."""
        if self._egress_proxy is not None:
            return True
        channel = self.sandbox.egress_channel
        if channel is None:
            return False
        raise_descriptor_limit()  # each egress connection holds two
        outbox = EgressOutbox()
        ledger = EgressLedger(self.sandbox_id, on_record=outbox.add)
        proxy = EgressProxy(
            policy=self.sandbox.spec.network, ceiling=ceiling, settings=settings, ledger=ledger
        )
        await proxy.start(
            channel.socket_path,
            peer_uid=channel.peer.uid,
            peer_gid=channel.peer_gid,
            peer_program=channel.peer.program,
        )
        self._egress_proxy, self._egress_ledger, self._egress_outbox = proxy, ledger, outbox
        return True

    async def next_egress_records(self, max_wait_s: float) -> EgressBatch:
        """Connections ended since the last poll (a long poll, see EgressOutbox.take)."""
        if self._egress_outbox is None:
            raise SandboxError("this session has no egress proxy")
        return await self._egress_outbox.take(max_wait_s)

    async def egress_totals(self) -> EgressTotals | None:
        """The proxy's running counts; None when the session has none."""
        return None if self._egress_ledger is None else self._egress_ledger.totals

    async def close_egress(self) -> None:
        """Stop the proxy (its open connections end and are recorded), give pollers up to
        DRAIN_S to take the records left, and log here what none took."""
        proxy, outbox = self._egress_proxy, self._egress_outbox
        if proxy is None or outbox is None:
            return
        self._egress_proxy = None
        try:
            await proxy.close()
        finally:
            outbox.close()
            if not await outbox.drained(DRAIN_S):
                left, dropped = outbox.leftovers()
                for r in left:
                    log.info(
                        "egress session=%s %s %s:%d %s address=%s up=%d down=%d: %s "
                        "(no service replica took this record)",
                        self.sandbox_id, r.method or "-", r.host or "-", r.port,
                        "allowed" if r.allowed else "refused", r.address or "-",
                        r.bytes_up, r.bytes_down, r.reason,
                    )  # fmt: skip
                if dropped:
                    log.warning(
                        "egress session=%s: %d records dropped, the outbox full", self.sandbox_id,
                        dropped,
                    )  # fmt: skip
