"""The session actor's end of its sandbox's egress: the proxy (sandbox/egress/) runs in the actor,
on the node, on the egress socket the node's backend made for the sandbox; what it records of
each connection waits in a bounded outbox until a service replica takes it, for the service's
log, metrics and audit.

Why on the node: the sandbox's socket is there and its connections leave from there; a replica
may be on any machine, or none may be connected for a while. So the decisions are made where
the sandbox is, with the policy the actor was made with and the ceiling and settings the
replica hands over (`open_egress`), and only the records travel, taken with a long poll
(`next_egress_records`, as the tool relay's calls are).

The outbox is bounded (sandbox/egress/outbox.py). The per-session caps (connections open at
once, bytes) hold exactly as on one machine, in the proxy itself; the caps a key's sessions and
the whole service share are counted for the whole cluster (egress_counter.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from code_interpreter_wire.errors import SandboxClosed, SandboxError
from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.backends.ray_cluster.egress_counter import CountedSlots
from sandbox.descriptors import raise_descriptor_limit
from sandbox.egress import EgressLedger, EgressProxy, EgressSettings
from sandbox.egress.outbox import EgressBatch, EgressOutbox, EgressReport
from sandbox.egress.slots import SharedCaps

if TYPE_CHECKING:
    from sandbox.backends.base import Sandbox

log = logging.getLogger(__name__)

DRAIN_S = 2.0  # at close, how long the records left wait for a poller before being logged here
LOGGED_LEFTOVERS = 20  # of those, at most this many logged one by one


class NodeEgress:
    """Mixin of the session actor: its sandbox's egress proxy and the records it keeps for the
    service. Its calls are not counted as the session's activity: replicas poll all the time."""

    _egress_proxy: EgressProxy | None = None
    _egress_ledger: EgressLedger | None = None
    _egress_outbox: EgressOutbox | None = None
    _egress_slots: CountedSlots | None = None
    _egress_opening: asyncio.Lock | None = None
    _egress_stopped = False  # for good: the session is closing

    if TYPE_CHECKING:  # given by the actor this is mixed into
        sandbox: Sandbox
        sandbox_id: str
        orchestrator_id: str
        namespace: str

    async def open_egress(
        self, ceiling: NetworkPolicy, settings: EgressSettings, caps: SharedCaps
    ) -> bool:
        """Start the sandbox's proxy with its own policy, the service's `ceiling`,
        `settings` and shared `caps` (counted for the cluster), if its sandbox has an egress
        socket; whether a proxy runs. Again, from any replica: nothing changes (the first
        ceiling, settings and caps hold). No socket, no proxy: the sandbox has no way out at
        all. Once the session closes: SandboxClosed."""
        async with self._egress_lock():  # two replicas at once start one proxy
            if self._egress_stopped:
                raise SandboxClosed("the session is closing: its egress proxy is gone")
            if self._egress_proxy is not None:
                return True
            channel = self.sandbox.egress_channel
            if channel is None:
                return False
            raise_descriptor_limit()  # each egress connection holds two
            outbox = EgressOutbox()
            ledger = EgressLedger(self.sandbox_id, on_record=outbox.add)
            slots = CountedSlots(self.sandbox_id, caps, self.orchestrator_id, self.namespace)
            proxy = EgressProxy(
                policy=self.sandbox.spec.network,
                ceiling=ceiling,
                settings=settings,
                ledger=ledger,
                slots=(slots,),
            )
            await proxy.start(
                channel.socket_path,
                peer_uid=channel.peer.uid,
                peer_gid=channel.peer_gid,
                peer_program=channel.peer.program,
            )
            self._egress_proxy, self._egress_ledger, self._egress_outbox = proxy, ledger, outbox
            self._egress_slots = slots
            return True

    def _egress_lock(self) -> asyncio.Lock:
        """Opening and stopping the proxy, one at a time (made in the actor's own loop)."""
        if self._egress_opening is None:
            self._egress_opening = asyncio.Lock()
        return self._egress_opening

    async def next_egress_records(self, max_wait_s: float) -> EgressBatch:
        """Connections ended since the last poll (a long poll, see EgressOutbox.take); still
        answered while the session closes, so its last records are taken."""
        if self._egress_outbox is None:
            raise SandboxError("this session has no egress proxy")
        return await self._egress_outbox.take(max_wait_s)

    async def egress_report(self, most: int) -> EgressReport | None:
        """The proxy's running totals and its latest `most` records (at most the ledger's
        1,000); None when the session has none."""
        if self._egress_ledger is None:
            return None
        return EgressReport.of(self._egress_ledger, most)

    async def stop_egress(self) -> None:
        """Stop the proxy for good, first as the session closes: its open connections end and
        are recorded, and no connection outlives the sandbox."""
        async with self._egress_lock():
            self._egress_stopped = True
            proxy, self._egress_proxy = self._egress_proxy, None
        try:
            if proxy is not None:
                await proxy.close()
            if self._egress_slots is not None:  # after the proxy gave back every slot
                await self._egress_slots.close()
        finally:
            if self._egress_outbox is not None:
                self._egress_outbox.close()

    async def drain_egress(self) -> None:
        """Last as the session closes: give pollers up to DRAIN_S to take the records left,
        and log here what none took (a warning: a Ray worker's log shows no less)."""
        outbox = self._egress_outbox
        if outbox is None or await outbox.drained(DRAIN_S):
            return
        left, dropped = outbox.leftovers()
        if len(left) > LOGGED_LEFTOVERS:
            log.warning(
                "egress session=%s: %d records no service replica took; the first %d follow",
                self.sandbox_id, len(left), LOGGED_LEFTOVERS,
            )  # fmt: skip
        for r in left[:LOGGED_LEFTOVERS]:
            log.warning("%s (no service replica took this record)", r.describe(self.sandbox_id))
        if dropped:
            log.warning(
                "egress session=%s: %d records dropped, the outbox full", self.sandbox_id, dropped
            )
