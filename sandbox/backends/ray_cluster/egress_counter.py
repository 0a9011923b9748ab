"""The egress caps a key's sessions share and the whole service shares
(`egress_max_connections_per_key`, `egress_max_connections_total`), counted once for the whole
cluster: each session's proxy runs on its own node (node_egress.py), so no node's count alone
could hold them.

One actor of the cluster keeps the count (`EgressCount`, named `cir-egress:<orchestrator id>`,
made by whichever session asks first, detached, restarted by Ray wherever there is room if its
node goes). Every connection a session's proxy would serve asks it first (`CountedSlots.take`)
and gives its slot back as it ends; a refusal names the cap reached, as on one machine.

What a count must survive:
- a node lost with its sessions' connections counted: each session holding connections says
  how many every `lease_s / 3` (`hold`); one not heard from for `lease_s` counts for nothing;
- the counting actor restarted (its node lost): it starts empty and is told every holding
  again within a heartbeat; until then the caps may let in up to that many more;
- calls of one session arriving out of order: the actor is synchronous, so Ray runs one
  caller's calls in the order they were made, and a session's `take` and `hold` never overlap.
A count that cannot be asked (no answer within `ANSWER_S`) refuses the connection, saying so:
a cap that cannot be checked is not waved through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from sandbox.backends.ray_cluster.names import egress_counter_name
from sandbox.egress.slots import SharedCaps

log = logging.getLogger(__name__)
ActorHandle = Any  # Ray's own is generic over a class it cannot see through ray.remote

LEASE_S = 30.0  # a holder not heard from for this long counts for nothing
ANSWER_S = 5.0  # how long a connection waits for the count before it is refused
_SWEEP_EVERY_S = 1.0


@dataclass
class _Holding:
    owner: str
    count: int
    seen: float  # when its holder was last heard from


class EgressCount:
    """The count, in one actor. Its methods are plain (not async): one call at a time."""

    def __init__(self, lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError("the lease must be positive")
        self.lease_s = lease_s
        self._clock = clock
        self._holdings: dict[str, _Holding] = {}
        self._by_owner: Counter[str] = Counter()
        self._total = 0
        self._swept = clock()

    def heartbeat_s(self) -> float:
        """How often a holder must say what it holds."""
        return self.lease_s / 3

    def take(self, holder: str, caps: SharedCaps) -> str | None:
        """One more connection of `holder` (a session's sandbox id), within its key's cap and
        the service's: None if taken, else what the connection is told."""
        self._sweep()
        if self._by_owner[caps.owner] >= caps.per_key:
            return caps.key_full()
        if self._total >= caps.total:
            return caps.total_full()
        held = self._holdings.get(holder)
        self._set(holder, caps.owner, (held.count if held else 0) + 1)
        return None

    def give_back(self, holder: str) -> None:
        held = self._holdings.get(holder)
        if held is not None:
            self._set(holder, held.owner, max(0, held.count - 1))

    def hold(self, holder: str, owner: str, count: int) -> None:
        """`holder` holds `count` connections now (its heartbeat; after a restart, the count
        anew)."""
        self._sweep()
        self._set(holder, owner, max(0, count))

    def drop(self, holder: str) -> None:
        """`holder`'s proxy stopped: whatever it held is free."""
        self._set(holder, "", 0)
        self._holdings.pop(holder, None)

    def counts(self) -> tuple[int, dict[str, int]]:
        """Connections held in all and by owner (those holding any)."""
        self._sweep()
        return self._total, {owner: n for owner, n in self._by_owner.items() if n > 0}

    def _set(self, holder: str, owner: str, count: int) -> None:
        old = self._holdings.get(holder)
        if old is not None:
            self._by_owner[old.owner] -= old.count
            self._total -= old.count
            if self._by_owner[old.owner] <= 0:
                del self._by_owner[old.owner]
        if owner:
            self._holdings[holder] = _Holding(owner, count, self._clock())
            self._by_owner[owner] += count
            self._total += count

    def _sweep(self) -> None:
        """Forget holders not heard from for a lease (their node is gone, or their proxy)."""
        now = self._clock()
        if now - self._swept < _SWEEP_EVERY_S:
            return
        self._swept = now
        for holder in [h for h, held in self._holdings.items() if now - held.seen > self.lease_s]:
            log.warning(
                "egress count: session %s not heard from for %.0f s; its %d connections freed",
                holder, self.lease_s, self._holdings[holder].count,
            )  # fmt: skip
            self.drop(holder)


_count_class: Any = None


def counter_of(orchestrator_id: str, namespace: str, *, lease_s: float = LEASE_S) -> ActorHandle:
    """The cluster's count for this service: the one already there, else a new one (Ray
    decides atomically which). `lease_s` only counts for a new one. Blocking: call it in a
    thread."""
    global _count_class
    if _count_class is None:
        _count_class = ray.remote(EgressCount)
    return _count_class.options(
        name=egress_counter_name(orchestrator_id),
        namespace=namespace,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=-1,  # it starts empty and is told every holding again
        max_task_retries=0,
        num_cpus=0,
    ).remote(lease_s)


class _Unanswered(Exception):
    pass


class CountedSlots:
    """A session's proxy's slots on a node (`Slots`, sandbox/egress/slots.py): each taken of
    the cluster's count, and while it holds any, its holding told again every heartbeat."""

    def __init__(self, holder: str, caps: SharedCaps, orchestrator_id: str, namespace: str):
        self.holder = holder
        self.caps = caps
        self.held = 0
        self._orchestrator_id = orchestrator_id
        self._namespace = namespace
        self._counter: ActorHandle | None = None
        self._heartbeat_s = LEASE_S / 3
        self._asking = asyncio.Lock()  # a take and a heartbeat never overlap
        self._beating: asyncio.Task[None] | None = None

    async def take(self) -> str | None:
        async with self._asking:
            try:
                refusal: str | None = await self._ask("take", self.holder, self.caps)
            except _Unanswered as exc:
                return (
                    "the cluster's count of egress connections (the caps a key's sessions and "
                    f"the whole service share) did not answer: {exc}; retry in a moment"
                )
        if refusal is None:
            self.held += 1
            if self._beating is None or self._beating.done():
                self._beating = asyncio.ensure_future(self._beat())
        return refusal

    def give_back(self) -> None:
        self.held = max(0, self.held - 1)
        counter = self._counter
        if counter is not None:  # not waited for: a lost one is set right by the next heartbeat
            with contextlib.suppress(RayError):
                counter.give_back.remote(self.holder)

    async def close(self) -> None:
        """The proxy stopped (after giving back each slot): the count forgets this holder."""
        beating, self._beating = self._beating, None
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        if self._counter is not None:
            with contextlib.suppress(_Unanswered):
                await self._ask("drop", self.holder)

    async def _beat(self) -> None:
        """While it holds connections: say how many, every heartbeat."""
        while self.held > 0:
            await asyncio.sleep(self._heartbeat_s)
            async with self._asking:
                try:
                    await self._ask("hold", self.holder, self.caps.owner, self.held)
                except _Unanswered as exc:
                    log.warning("egress count: session %s's heartbeat failed: %s", self.holder, exc)

    async def _ask(self, method: str, *args: Any) -> Any:
        """Call the count; a count gone for good is found (or made) again, once."""
        for again in (False, True):
            counter = await self._count()
            try:
                return await asyncio.wait_for(getattr(counter, method).remote(*args), ANSWER_S)
            except (TimeoutError, GetTimeoutError):
                raise _Unanswered(f"no answer within {ANSWER_S:g} s") from None
            except RayActorError as exc:
                self._counter = None
                if again:
                    raise _Unanswered(str(exc).splitlines()[0][:200]) from None
            except RayError as exc:
                raise _Unanswered(str(exc).splitlines()[0][:200]) from None
        raise AssertionError("unreachable")

    async def _count(self) -> ActorHandle:
        if self._counter is None:
            try:
                counter = await asyncio.to_thread(
                    counter_of, self._orchestrator_id, self._namespace
                )
                beat: float = await asyncio.wait_for(counter.heartbeat_s.remote(), ANSWER_S)
            except (TimeoutError, GetTimeoutError):
                raise _Unanswered(f"no answer within {ANSWER_S:g} s") from None
            except RayError as exc:
                raise _Unanswered(str(exc).splitlines()[0][:200]) from None
            self._counter, self._heartbeat_s = counter, float(beat)
        return self._counter
