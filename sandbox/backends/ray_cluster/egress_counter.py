"""The egress caps a key's sessions share and the whole service shares
(`egress_max_connections_per_key`, `egress_max_connections_total`), counted once for the whole
cluster: each session's proxy runs on its own node (node_egress.py), so no node's count alone
could hold them.

One actor of the cluster keeps the count (`EgressCount`, named `cir-egress:<orchestrator id>`,
made on the head node by whichever session asks first, detached, restarted by Ray if it dies).
Every connection a session's proxy would serve asks it first (`CountedSlots.take`) and gives its
slot back as it ends; a refusal names the cap reached, as on one machine.

What a count must survive:
- a node lost with its sessions' connections counted: each session holding connections says
  how many every `lease_s / 3` (`hold`); one not heard from for `lease_s` counts for nothing;
- the counting actor restarted: it starts empty and is told every holding again within a
  heartbeat; until then the caps may let in up to that many more;
- calls of one session arriving out of order: the actor is synchronous, so Ray runs one
  caller's calls in the order they were made, and a session's `take` and `hold` never overlap;
  a call that may have been lost or run late (a give-back sent to no count, a take that timed
  out) has the next heartbeat tell the count anew, even of none;
- a sandbox connecting in a loop: a session asks at most `ASKS_PER_S` times a second (the
  connections past that wait in its socket's backlog), and once refused by a shared cap it is
  refused here for `REFUSED_FOR_S` without asking again.
A count that cannot be asked (no answer within `ANSWER_S`, all told) refuses the connection,
saying so: a cap that cannot be checked is not waved through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from sandbox.backends.ray_cluster.names import egress_counter_name
from sandbox.egress.slots import UNCHECKED, Refusal, SharedCaps

log = logging.getLogger(__name__)
ActorHandle = Any  # Ray's own is generic over a class it cannot see through ray.remote

LEASE_S = 30.0  # a holder not heard from for this long counts for nothing
ANSWER_S = 5.0  # how long a connection waits for the count, all told, before it is refused
ASKS_PER_S = 50  # a session's takes a second; past it, its connections wait their turn
REFUSED_FOR_S = 0.5  # after a shared cap refused a session, it is refused without asking
_SWEEP_EVERY_S = 1.0
# Ray places a resource of this name on the head node alone (Ray's own detached state actors
# are pinned there the same way): the count lives and dies with the cluster's head, never on a
# node running sandboxes.
_HEAD_NODE = "node:__internal_head__"


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
        self._incarnation = uuid.uuid4().hex  # a restarted count is told apart by this
        self._takes = 0  # takes asked of it since it started
        self._holdings: dict[str, _Holding] = {}
        self._by_owner: Counter[str] = Counter()
        self._total = 0
        self._swept = clock()

    def heartbeat_s(self) -> float:
        """How often a holder must say what it holds."""
        return self.lease_s / 3

    def incarnation(self) -> str:
        return self._incarnation

    def takes(self) -> int:
        """Takes asked of it since it started (what each session's pace holds down)."""
        return self._takes

    def take(self, holder: str, caps: SharedCaps) -> Refusal | None:
        """One more connection of `holder` (a session's sandbox id), within its key's cap and
        the service's: None if taken, else what the connection is told."""
        self._takes += 1
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

    def counts(self) -> tuple[int, dict[str, int]]:
        """Connections held in all and by owner (those holding any)."""
        self._sweep()
        return self._total, {owner: n for owner, n in self._by_owner.items() if n > 0}

    def _set(self, holder: str, owner: str, count: int) -> None:
        """`holder` holds `count` now (none: it is forgotten)."""
        old = self._holdings.pop(holder, None)
        if old is not None:
            self._by_owner[old.owner] -= old.count
            self._total -= old.count
            if self._by_owner[old.owner] <= 0:
                del self._by_owner[old.owner]
        if count > 0:
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
                "egress count: session %s not heard from for %.0f s (its node lost?); its %d "
                "connections freed",
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
        resources={_HEAD_NODE: 0.001},
        scheduling_strategy="DEFAULT",  # not the asking session's node
    ).remote(lease_s)


class _Unanswered(Exception):
    pass


class CountedSlots:
    """A session's proxy's slots on a node (`Slots`, sandbox/egress/slots.py): each taken of
    the cluster's count; while it holds any (or a call may have gone astray), its holding is
    told again every heartbeat."""

    def __init__(self, holder: str, caps: SharedCaps, orchestrator_id: str, namespace: str):
        self.holder = holder
        self.caps = caps
        self.held = 0
        self._orchestrator_id = orchestrator_id
        self._namespace = namespace
        self._counter: ActorHandle | None = None
        self._finding: asyncio.Future[ActorHandle] | None = None  # one lookup at a time
        self._heartbeat_s = LEASE_S / 3
        self._asking = asyncio.Lock()  # a take and a heartbeat never overlap
        self._beating: asyncio.Task[None] | None = None
        self._astray = False  # a call may have been lost or run late: tell the count anew
        self._refused_until = 0.0
        self._refused: Refusal | None = None
        self._pace = MovingWindowRateLimiter(MemoryStorage())
        self._rate = RateLimitItemPerSecond(ASKS_PER_S)

    async def take(self) -> Refusal | None:
        if time.monotonic() < self._refused_until and self._refused is not None:
            return self._refused
        if not self._pace.hit(self._rate, self.holder):  # wait for the window to move
            window = self._pace.get_window_stats(self._rate, self.holder)
            await asyncio.sleep(min(1.0, max(0.0, window.reset_time - time.time())))
            self._pace.hit(self._rate, self.holder)
        try:
            async with asyncio.timeout(ANSWER_S), self._asking:  # the wait for a heartbeat too
                refusal: Refusal | None = await self._ask(self._take)
        except (_Unanswered, TimeoutError) as exc:
            self._astray = True  # the take may yet run: the next heartbeat says how many
            self._keep_telling()
            log.warning("egress count: session %s's connection refused: %s", self.holder, exc)
            refusal = Refusal(
                UNCHECKED,
                "the cluster's count of egress connections (the caps a key's sessions and the "
                "whole service share) did not answer; retry in a moment",
            )
        if refusal is None:
            self.held += 1
            self._keep_telling()
        else:  # held a moment: a sandbox connecting in a loop is answered here meanwhile
            self._refused, self._refused_until = refusal, time.monotonic() + REFUSED_FOR_S
        return refusal

    def give_back(self) -> None:
        self.held = max(0, self.held - 1)
        self._refused_until = 0.0  # a slot of its own is free again: ask
        counter = self._counter
        if counter is None:
            self._astray = True
            self._keep_telling()
            return
        try:  # not waited for: one lost is set right by the next heartbeat
            counter.give_back.remote(self.holder)
        except Exception:
            self._astray = True
            self._keep_telling()

    async def close(self) -> None:
        """The proxy stopped (after giving back each slot): the count forgets this holder. Only
        a count already found is told (one gone forgets it after a lease); none is made."""
        for task in (self._beating, self._finding):
            if task is not None:
                task.cancel()
        beating, self._beating, self._finding = self._beating, None, None
        if beating is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        with contextlib.suppress(Exception):
            async with asyncio.timeout(ANSWER_S):
                counter: ActorHandle = self._counter or await asyncio.to_thread(self._existing)
                await counter.drop.remote(self.holder)

    def _existing(self) -> ActorHandle:
        """The count if there is one (ValueError if not): never makes one."""
        return ray.get_actor(egress_counter_name(self._orchestrator_id), self._namespace)

    def _keep_telling(self) -> None:
        if self._beating is None or self._beating.done():
            self._beating = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        """While it holds connections, or a call may have gone astray: say how many, every
        heartbeat (the count read as the call is sent, after every call sent before it)."""
        while self.held > 0 or self._astray:
            await asyncio.sleep(self._heartbeat_s)
            async with self._asking:
                try:
                    astray, self._astray = self._astray, False
                    await self._ask(self._tell)
                except _Unanswered as exc:
                    self._astray = astray or self._astray
                    log.warning("egress count: session %s's heartbeat failed: %s", self.holder, exc)

    def _take(self, counter: ActorHandle) -> Any:
        return counter.take.remote(self.holder, self.caps)

    def _tell(self, counter: ActorHandle) -> Any:
        """What it holds, read as the call is sent."""
        return counter.hold.remote(self.holder, self.caps.owner, self.held)

    async def _ask(self, call: Callable[[ActorHandle], Any]) -> Any:
        """`call` the count, within `ANSWER_S` all told; a count gone for good is found (or
        made) again, once."""
        try:
            async with asyncio.timeout(ANSWER_S):
                for again in (False, True):
                    counter = await self._count()
                    try:
                        return await call(counter)
                    except ray.exceptions.RayActorError as exc:
                        self._counter = None
                        self._astray = True  # it may have run all the same: told anew
                        if again:
                            raise _Unanswered(_first_line(exc)) from None
        except TimeoutError:
            raise _Unanswered(f"no answer within {ANSWER_S:g} s") from None
        except _Unanswered:
            raise
        except Exception as exc:  # Ray's other errors, and whatever else a lookup raises
            raise _Unanswered(_first_line(exc)) from None
        raise AssertionError("unreachable")

    async def _count(self) -> ActorHandle:
        """The count's handle, looked up (in a thread: Ray's lookup blocks) by one caller at a
        time; the others wait for the same lookup."""
        if self._counter is not None:
            return self._counter
        if self._finding is None or self._finding.done():
            self._finding = asyncio.ensure_future(self._find())
            # Its error is its waiters' (one that gave up leaves it unread otherwise).
            self._finding.add_done_callback(lambda f: f.cancelled() or f.exception())
        counter: ActorHandle = await asyncio.shield(self._finding)
        return counter

    async def _find(self) -> ActorHandle:
        counter = await asyncio.to_thread(counter_of, self._orchestrator_id, self._namespace)
        self._heartbeat_s = float(await asyncio.wait_for(counter.heartbeat_s.remote(), ANSWER_S))
        self._counter = counter
        return counter


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
