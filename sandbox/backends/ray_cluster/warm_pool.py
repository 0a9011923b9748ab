"""Warm pools per node: session actors started ahead of demand on each node of the cluster, so
that creating a session there is a hand-over, not a start.

One keeper per node and pool spec (`PoolKeeper`): a detached actor pinned to its node, named
`cir-pool:<orchestrator id>:<spec digest>:<node id>` and made with Ray's `get_if_exists`, so
every replica that asks gets the same one and none makes a second. The keeper starts the warm
session actors on its own node, holds the ready ones, and hands each out exactly once (`take`
pops it in the keeper's single event loop; the actor's own `hand_over` answers only its first
caller). It refills itself after each take, in the background, one actor at a time; it never
holds more than the pool size (ready and starting counted together), and it only starts one
into a slot its node has free. A node lost takes its keeper and its warm actors with it.

How the pool and the node's cap (`cir_sessions`) share the slots: a warm actor holds a slot
like a session does, so it counts in the node's `sessions`, and its `warm` too. A slot held
warm is on loan: a session that fits the pool takes a warm actor first; a session that does
not fit, on a node whose free slots are all held warm, makes the keeper give one back (the warm
actor ends, its slot goes to the session) before its own actor starts, and so does a session
actor that stays unplaced for a moment (the keeper filled the slot it was aiming at). After
giving a slot back the keeper waits `QUIET_AFTER_GIVE_BACK_S` before it looks for room again,
so a real session is never refused while warm actors sit on a node.

`WarmPools` is the replica's side: it finds (or makes) each node's keeper, takes from it, asks
it for slots, reads its state, and drains every keeper of the service (`drain`). Keepers
belong to the cluster, not to a replica: a replica's `close()` leaves them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.cluster_state import free_resources_per_node
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.machine_store import machine_store
from sandbox.backends.ray_cluster.names import (
    SESSION_RESOURCE,
    pool_keeper_name,
    pool_prefix,
    session_actor_name,
)
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox, kill_actor
from sandbox.backends.ray_cluster.session_actor import SessionFacts
from sandbox.backends.ray_cluster.session_start import new_session_actor, start_session

log = logging.getLogger(__name__)

REFILL_CHECK_S = 2.0  # how often a keeper short of its size looks for a free slot
QUIET_AFTER_GIVE_BACK_S = 5.0  # after giving a slot back, the session that needed it goes first
KEEPER_ANSWER_S = 60.0  # longest wait for a keeper's answer (it may still be starting)
_MAX_BACKOFF_S = 30.0
# A Ray actor handle: Ray types an actor's methods as reached by name only.
ActorHandle = Any


@dataclass(frozen=True)
class PoolState:
    """One node's pool, as its keeper tells it."""

    node_id: str
    size: int
    ready: tuple[str, ...]  # the warm session actors' names, next to be handed out first
    starting: int
    handed_out: int  # since the keeper started
    given_back: int  # slots given back to sessions that did not fit the pool
    failures: int  # warm starts that failed in a row (0 once one succeeds)


@dataclass(frozen=True)
class _Warm:
    name: str
    actor: ActorHandle
    facts: SessionFacts


class PoolKeeper:
    """One node's warm pool (made with `ray.remote` in `WarmPools`; one per node and spec).

    Every method first makes sure the keeper is filling (its event loop only runs once Ray has
    called into it): there is no separate start. A warm actor is `placing` until Ray placed it
    (killing it then leaves nothing behind), then `starting` while its sandbox starts (it is
    only ever closed, so that its sandbox goes with it), then ready."""

    def __init__(self, config: RayBackendConfig, node_id: str) -> None:
        self.config = config
        self.node_id = node_id
        self.size = config.pool_size_per_node
        self._ready: deque[_Warm] = deque()
        self._starting: dict[str, ActorHandle] = {}  # placing or starting
        self._placed: set[str] = set()  # of those, starting
        self._doomed: set[str] = set()  # starting, to end as soon as started
        self._leaving: dict[str, ActorHandle] = {}  # given back or drained, not yet gone
        self._closed = False
        self._closing = asyncio.Event()
        self._quiet_until = 0.0
        self._handed_out = 0
        self._given_back = 0
        self._failures = 0
        self._filler: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._kills: set[asyncio.Task[None]] = set()

    # --- what replicas call -----------------------------------------------------------------

    async def take(self) -> tuple[str, ActorHandle, SessionFacts] | None:
        """The next ready warm actor, out of the pool for good (None: none ready). No await
        between looking and popping: two callers never get the same one."""
        self._wake()
        if not self._ready:
            return None
        warm = self._ready.popleft()
        self._handed_out += 1
        self._wake()  # refill in the background
        return warm.name, warm.actor, warm.facts

    async def give_back(self) -> bool:
        """End one warm actor (a ready one, else one starting, else one being placed) so that
        its slot goes to a session that needs it; False when the pool holds none. Refilling
        waits `QUIET_AFTER_GIVE_BACK_S`, so that the session gets there first."""
        self._wake()
        self._quiet_until = time.monotonic() + QUIET_AFTER_GIVE_BACK_S
        if self._ready:
            warm = self._ready.pop()  # the newest: the oldest ones are handed out first
            self._given_back += 1
            await self._end(warm.name, warm.actor)
            return True
        starting = [n for n in self._starting if n in self._placed and n not in self._doomed]
        if starting:
            self._doomed.add(starting[0])
            self._given_back += 1
            if self._filler is not None:  # it ends the doomed one, then stops (quiet)
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._filler)
            return True
        placing = [n for n in self._starting if n not in self._placed]
        if placing:
            self._given_back += 1
            self._withdraw(placing[0])
            return True
        return False

    async def held(self) -> list[str]:
        """Every session actor this keeper holds (ready, starting, or ending): not sessions."""
        self._wake()
        return [w.name for w in self._ready] + [*self._starting] + [*self._leaving]

    async def state(self) -> PoolState:
        self._wake()
        return PoolState(
            node_id=self.node_id,
            size=self.size,
            ready=tuple(w.name for w in self._ready),
            starting=len(self._starting),
            handed_out=self._handed_out,
            given_back=self._given_back,
            failures=self._failures,
        )

    async def drain(self) -> int:
        """Stop filling and end every warm actor held; how many were ended. The keeper stays
        (closed) until it is killed."""
        ended = len(self._ready) + len(self._starting)
        self._closed = True
        self._closing.set()
        if self._ticker is not None:
            self._ticker.cancel()
        for name in [n for n in self._starting if n not in self._placed]:
            self._withdraw(name)
        if self._filler is not None:  # it ends what it was starting, as closed
            with contextlib.suppress(Exception):
                await self._filler
        warm = list(self._ready)
        self._ready.clear()
        await asyncio.gather(*(self._end(w.name, w.actor) for w in warm))
        return ended

    async def close(self) -> None:
        """Drain, then end the keeper itself (what a generic clean-up calls on any actor)."""
        await self.drain()
        ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    # --- filling ----------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._closed:
            return
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_forever())
        self._fill()

    def _fill(self) -> None:
        idle = self._filler is None or self._filler.done()
        if idle and not self._closed and self._lacking() > 0:
            self._filler = asyncio.ensure_future(self._fill_while_lacking())

    def _lacking(self) -> int:
        return self.size - len(self._ready) - len(self._starting)

    async def _tick_forever(self) -> None:
        """Look again now and then: a node that was full may have room now."""
        while not self._closed:
            await asyncio.sleep(REFILL_CHECK_S)
            self._fill()

    async def _fill_while_lacking(self) -> None:
        """Start warm actors one at a time while the pool lacks some and the node has room."""
        while not self._closed and self._lacking() > 0:
            if time.monotonic() < self._quiet_until or await self._free_slots() <= 0:
                return  # the next tick looks again
            if not await self._start_one():
                if not self._failures:
                    return  # no room after all: the next tick looks again
                with contextlib.suppress(TimeoutError):  # back off (drain cuts it short)
                    backoff = min(_MAX_BACKOFF_S, 0.5 * 2**self._failures)
                    await asyncio.wait_for(self._closing.wait(), backoff)

    async def _free_slots(self) -> int:
        available = await asyncio.to_thread(free_resources_per_node)
        return int(available.get(self.node_id, {}).get(SESSION_RESOURCE, 0))

    async def _start_one(self) -> bool:
        """Start one warm actor on this node; False when it failed, found no room, or was
        given back meanwhile."""
        sandbox_id = secrets.token_hex(8)
        name = session_actor_name(self.config.orchestrator_id, sandbox_id)
        spec = self.config.pool_spec.model_copy(deep=True)
        actor = await asyncio.to_thread(  # a named actor: a GCS round trip
            lambda: new_session_actor(
                name,
                self.config.namespace,
                self.node_id,
                sandbox_id,
                spec,
                self.config,
                claimed=False,
            )
        )
        self._starting[name] = actor
        placed = False
        facts: SessionFacts | None = None
        keep = False
        try:
            with contextlib.suppress(TimeoutError, RayActorError):  # unplaced, or withdrawn
                await asyncio.wait_for(actor.describe.remote(), self.config.placement_wait_s)
                placed = name in self._starting and not self._closed
            if placed:
                self._placed.add(name)
                facts = await start_session(actor, name)
        except Exception:
            self._failures += 1
            log.exception("the warm pool of node %s could not start a sandbox", self.node_id[:16])
        finally:
            self._starting.pop(name, None)
            self._placed.discard(name)
            keep = facts is not None and name not in self._doomed and not self._closed
            self._doomed.discard(name)
            if placed and not keep:
                await self._end(name, actor)  # its sandbox may exist: closed, not killed
            elif not keep:
                await kill_actor(actor)
                self._leaving.pop(name, None)
        if facts is None or not keep:
            return False
        self._failures = 0
        self._ready.append(_Warm(name, actor, facts))
        return True

    def _withdraw(self, name: str) -> None:
        """Kill a warm actor not placed yet (it holds no sandbox): `_start_one` sees it end."""
        actor = self._starting.pop(name)
        self._leaving[name] = actor
        task = asyncio.ensure_future(kill_actor(actor))  # off the loop; `_start_one` sees it end
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _end(self, name: str, actor: ActorHandle) -> None:
        """Close a warm actor (its sandbox, then its process): its slot goes back to the node."""
        self._leaving[name] = actor
        try:
            with contextlib.suppress(RayActorError):  # it ends itself as it answers
                await asyncio.wait_for(actor.close.remote(), KEEPER_ANSWER_S)
        except Exception:
            log.exception("a warm actor of node %s did not close; killed", self.node_id[:16])
        finally:
            await kill_actor(actor)
            self._leaving.pop(name, None)


# --- the replica's side ---------------------------------------------------------------------


class WarmPools:
    """A replica's door to the cluster's keepers (one per node for its pool spec)."""

    def __init__(self, config: RayBackendConfig) -> None:
        self.config = config
        self._keepers: dict[str, ActorHandle] = {}  # node id -> keeper

    @property
    def enabled(self) -> bool:
        # Networked sandboxes are never kept warm: each proxy is opened for its own session.
        return self.config.pool_size_per_node > 0 and not self.config.pool_spec.network.enabled

    def fits(self, spec: SandboxSpec) -> bool:
        """Whether a session of `spec` may be a warm actor: the pool's spec except for the
        environment (the session's is added on taking, over the pool's, which it must keep)
        and the working directory (set on taking), as a fresh sandbox of `spec` would be."""
        pool = self.config.pool_spec
        if not self.enabled or any(spec.env.get(k) != v for k, v in pool.env.items()):
            return False
        return spec.model_copy(update={"env": pool.env, "workdir": pool.workdir}) == pool

    async def take(self, node_id: str, spec: SandboxSpec) -> RaySandbox | None:
        """A warm actor of that node made into a session of `spec` (None: none ready there)."""
        keeper = await self._keeper(node_id)
        pool = self.config.pool_spec
        env = {k: v for k, v in spec.env.items() if pool.env.get(k) != v}
        workdir = spec.workdir if spec.workdir != pool.workdir else None
        for _ in range(self.config.pool_size_per_node + 1):
            try:
                taken = await asyncio.wait_for(keeper.take.remote(), KEEPER_ANSWER_S)
            except (TimeoutError, RayActorError):
                self._keepers.pop(node_id, None)
                return None
            if taken is None:
                return None
            name, actor, _ = taken
            try:
                facts: SessionFacts | None = await actor.hand_over.remote(env, workdir)
            except RayActorError:
                continue  # it died while warm: the next one
            except RayTaskError as exc:  # its environment could not be set: it goes
                with contextlib.suppress(Exception):  # closed (its sandbox too), not awaited
                    actor.close.remote()
                if isinstance(exc.cause, Exception):
                    raise exc.cause from None
                raise
            if facts is not None:
                machines = machine_store(self.config.machine_images_dir)
                return RaySandbox(actor, name, spec, facts, machines)
        return None

    async def give_back(self, node_id: str) -> bool:
        """Ask that node's keeper to end a warm actor, so that a session gets its slot."""
        keeper = self._keepers.get(node_id)
        if keeper is None:
            return False
        try:
            given: bool = await asyncio.wait_for(keeper.give_back.remote(), KEEPER_ANSWER_S)
        except (TimeoutError, RayActorError):
            self._keepers.pop(node_id, None)
            return False
        return given

    async def states(self, node_ids: list[str]) -> dict[str, PoolState]:
        """The pools of those (alive) nodes; a keeper is made where there is none yet."""

        async def one(node_id: str) -> PoolState | None:
            keeper = await self._keeper(node_id)
            try:
                state: PoolState = await asyncio.wait_for(keeper.state.remote(), KEEPER_ANSWER_S)
            except (TimeoutError, RayActorError):
                self._keepers.pop(node_id, None)  # its node died (or it was drained)
                return None
            return state

        found = await asyncio.gather(*(one(node_id) for node_id in node_ids))
        return {state.node_id: state for state in found if state is not None}

    async def _keeper(self, node_id: str) -> ActorHandle:
        keeper = self._keepers.get(node_id)
        if keeper is None:
            keeper = await asyncio.to_thread(_keeper_of, self.config, node_id)
            self._keepers[node_id] = keeper
        return keeper

    def forget(self) -> None:
        self._keepers.clear()

    # --- every keeper of the service (any spec, made by any replica) -----------------------

    async def held(self, names: list[str]) -> set[str]:
        """The session actors every keeper among `names` holds (warm: not sessions)."""
        held: set[str] = set()
        for keeper in await asyncio.to_thread(self._every_keeper, names):
            with contextlib.suppress(RayActorError, GetTimeoutError, TimeoutError):
                held.update(await asyncio.wait_for(keeper.held.remote(), KEEPER_ANSWER_S))
        return held

    async def drain(self, names: list[str]) -> int:
        """End every keeper among `names` and the warm actors it holds; how many warm ones.
        Returns once the cluster no longer names them (or after `KEEPER_ANSWER_S`)."""
        ended = 0
        held = await self.held(names)
        keepers = await asyncio.to_thread(self._every_keeper, names)
        for keeper in keepers:
            with contextlib.suppress(RayActorError, TimeoutError):
                ended += await asyncio.wait_for(keeper.drain.remote(), KEEPER_ANSWER_S)
            await kill_actor(keeper)
        self.forget()
        prefix = pool_prefix(self.config.orchestrator_id)
        deadline = time.monotonic() + KEEPER_ANSWER_S
        while keepers and time.monotonic() < deadline:
            left = await asyncio.to_thread(_named_actors, self.config.namespace)
            if not any(name.startswith(prefix) or name in held for name in left):
                break
            await asyncio.sleep(0.1)
        return ended

    def _every_keeper(self, names: list[str]) -> list[ActorHandle]:
        prefix = pool_prefix(self.config.orchestrator_id)
        keepers = []
        for name in names:
            if name.startswith(prefix):
                with contextlib.suppress(ValueError):  # ended meanwhile
                    keepers.append(ray.get_actor(name, self.config.namespace))
        return keepers


_keeper_class: Any = None


def _keeper_of(config: RayBackendConfig, node_id: str) -> ActorHandle:
    """That node's keeper: the one already there, else a new one (Ray decides atomically)."""
    global _keeper_class
    if _keeper_class is None:
        _keeper_class = ray.remote(PoolKeeper)
    return _keeper_class.options(
        name=pool_keeper_name(config.orchestrator_id, config.pool_spec, node_id),
        namespace=config.namespace,
        get_if_exists=True,
        lifetime="detached",
        max_restarts=0,  # its warm actors are not known to a fresh keeper: none is made
        max_task_retries=0,
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(config, node_id)


def _named_actors(namespace: str) -> list[str]:
    found = ray.util.list_named_actors(all_namespaces=True)
    return [e["name"] for e in found if isinstance(e, dict) and e.get("namespace") == namespace]
