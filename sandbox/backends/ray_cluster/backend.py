"""The `ray` backend: each session is a detached, named Ray actor (session_actor.py) on a node
of a Ray cluster, running a sandbox of that node's own kind; `RaySandbox` is its proxy here.

Placement spreads sessions by free capacity: a node offers sessions with the custom resource
`cir_sessions` (its cap, `ray start --resources='{"cir_sessions": N}'`); `create` picks the
alive node with the most free slots (ties at random, so that replicas do not all pick the same
node) and pins the actor there (`NodeAffinitySchedulingStrategy(soft=False)`). If that node
filled meanwhile, the actor stays pending: past `placement_wait_s` it is withdrawn and the next
node is tried. Every node full is `CapacityReached`, saying how full. Ray enforces each node's
cap through the resource; nothing here counts sessions on its own.

Warm pools per node (`pool_size_per_node`, warm_pool.py): a keeper per node holds ready
session actors of `pool_spec`, shared by every replica. A warm actor holds a slot like a
session, so the cap and the pool share a node's slots this way: placement ranks nodes by the
slots a session could have there now (free ones, and those held warm); on the chosen node a
session that fits the pool takes a warm actor first (else one is started, as without a pool);
a session that does not fit, where every free slot is held warm, has the keeper give one back
first; and an actor that stays unplaced for `NUDGE_S` (a keeper filled the slot meanwhile)
has it give one back too. The pool never holds more than `pool_size_per_node` per node, and
only fills free slots; so warm actors never make a session wait or be refused.

The backend belongs to one replica; the session actors belong to the cluster. `close()` only
lets go of this process's connection; `discard(handle)` ends a session actor for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import secrets
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

import ray
from ray.exceptions import ActorDiedError, RayActorError

from code_interpreter_wire.errors import (
    BackendTimeout,
    BackendUnavailable,
    CapacityReached,
    SandboxError,
    SandboxLost,
    SandboxStartError,
)
from code_interpreter_wire.languages import PYTHON
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.base import Backend, BackendCapabilities, SavedSandboxUnusable
from sandbox.backends.ray_cluster.actor_errors import (
    actor_id_of,
    known_fate,
    lost_by_name,
    sandbox_error_of,
)
from sandbox.backends.ray_cluster.cluster_state import (
    cluster_nodes,
    creation_error,
    free_resources_per_node,
    short,
)
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.joining import give_back_sigterm, join_cluster, leave_cluster
from sandbox.backends.ray_cluster.machine_store import (
    MachineStore,
    image_cap,
    machine_store,
    send_tree,
)
from sandbox.backends.ray_cluster.names import (
    SESSION_RESOURCE,
    session_actor_name,
    session_prefix,
)
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox, kill_actor
from sandbox.backends.ray_cluster.session_actor import SessionFacts
from sandbox.backends.ray_cluster.session_start import new_session_actor, start_session
from sandbox.backends.ray_cluster.warm_pool import PoolState, WarmPools
from sandbox.tree_transfer import TreeEntry, tree_bytes

log = logging.getLogger(__name__)

NUDGE_S = 1.0  # an actor unplaced this long asks its node's keeper for a slot held warm
RECHECK_S = 0.5  # no node with room: the free slots are read once more after this long
# A slot this replica just filled may still look free in the GCS's view for about this long.
GCS_LAG_S = 2.0
# A half-carried image of a paused machine untouched this long was left by a replica killed while
# carrying it: no carrying lasts this long (`cleanup_orphans`).
PARTIAL_AFTER_S = 3600.0
MAX_DEAD_NODES = 64  # dead nodes `nodes()` still lists (the most recently seen alive)


@dataclass(frozen=True)
class NodeUsage:
    """One node of the cluster as the ray backend sees it."""

    node_id: str
    address: str
    alive: bool
    sessions: int  # slots taken (warm actors included: they hold one each)
    capacity: int  # its `cir_sessions`
    warm: int = 0  # warm actors ready there

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.sessions) if self.alive else 0

    @property
    def room(self) -> int:
        """Slots a session could have there now: free ones, and those held warm (on loan)."""
        return self.free + self.warm if self.alive else 0


class _Unplaced(Exception):
    """The actor stayed pending: its node filled meanwhile (or died)."""


class _CannotRestore(Exception):
    """The actor's node does not restore whole machines: the next node may."""


class _NodeCannotRestore(Exception):
    """The actor's node failed to restore this machine, for a reason of its own (its runsc,
    its images, its worker): the next node may not fail so."""


@dataclass(frozen=True)
class _Restore:
    """A saved machine a session starts from: woken (`"wake"`) or forked (`"fork"`)."""

    saved: Path
    how: str
    max_bytes: int


async def _carried_cap(saved: Path, spec: SandboxSpec) -> int:
    """The bound on a saved machine carried to a node: its spec's, or what it holds if more
    (a snapshot made under a larger spec than the fork's; the store is the service's own)."""
    held = await asyncio.to_thread(tree_bytes, saved)
    return max(image_cap(spec), held + (1 << 20))


class RayBackend(Backend):
    name = "ray"
    capabilities = BackendCapabilities(
        # Through a proxy in the session's actor, on its node (node_egress.py), whose records
        # the driver takes (`egress_relayed`: the service does).
        network_modes=("none", "allow_list", "any"),
        host_tools=True,  # relayed from the sandbox's node (node_tool_relay.py)
        processes=True,
        # Whole machines where the node's backend saves them (gVisor), carried to a store
        # every replica mounts (node_machines.py, machine_store.py); elsewhere None, and
        # the kernel's state is saved instead.
        suspend=True,
        # Saved through the actor like any sandbox's; the service keeps them where every
        # replica finds them (its `saved_states_dir`), else it refuses.
        snapshot=True,
        shared_across_nodes=True,
        images=False,
        runtimes=False,
        # A warm sandbox here is a cluster actor: replicas share per-node pools (warm_pool.py),
        # never a replica's own pool of actors no record names.
        warm_pool=False,
        labels_sandboxes=True,  # actors in a cluster other services may share
        host_dirs=False,  # its nodes keep them, under their own state dirs
        ports=False,  # its sandboxes' processes live on other nodes' actors
        # Its nodes' backends mount them: a directory every node mounts at the same path
        # (the service's `volumes_dir`, docs/volumes.md).
        mounts=True,
    )

    @classmethod
    def configured(cls, **config: Any) -> Self:
        return cls(RayBackendConfig(**config))

    def __init__(self, config: RayBackendConfig | None = None) -> None:
        self.config = config or RayBackendConfig()
        self._connected = False
        self._connect_lock = asyncio.Lock()
        self._joining: asyncio.Future[None] | None = None
        self._pools = WarmPools(self.config)
        # Nodes seen offering sessions: node id -> capacity, newest last. A dead node's
        # resources are no longer told, so this is how `nodes()` still lists one (and only
        # those that offered sessions, the most recent MAX_DEAD_NODES).
        self._seen: dict[str, int] = {}
        # Sessions this replica is placing (or placed a moment ago) on each node: the GCS's
        # view does not count them yet, so concurrent creates here would all aim at the same
        # last slot, and all but one wait out placement_wait_s. Ranking subtracts them.
        self._placing: dict[str, int] = {}
        # Whether each node's backend restores whole machines, as its actors said.
        self._whole_saves: dict[str, bool] = {}
        self._machines = machine_store(self.config.machine_images_dir)

    # --- the cluster connection -------------------------------------------------------------

    async def _connect(self) -> None:
        async with self._connect_lock:
            if self._connected:
                return
            joining = self._joining
            if joining is None or (joining.done() and not self._connected):
                # One join at a time, shielded: a caller that leaves mid-join leaves it to
                # finish (counted once); the next caller waits for the same one.
                joining = self._joining = asyncio.ensure_future(self._join())
        await asyncio.shield(joining)

    async def _join(self) -> None:
        await asyncio.to_thread(join_cluster, self.config)
        give_back_sigterm()
        self._connected = True

    async def close(self) -> None:
        """Let go of the cluster (the session actors and the pools' keepers stay: they belong
        to it; `drain_pools` ends the keepers)."""
        self._pools.forget()
        joining = self._joining
        if joining is not None and not joining.done():  # a join under way finishes first
            with contextlib.suppress(Exception):
                await asyncio.shield(joining)
        if self._connected:
            self._connected = False
            await asyncio.to_thread(leave_cluster)
            give_back_sigterm()  # Ray's shutdown sets it back to the default: ended at once

    # --- sessions ---------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec | None = None) -> RaySandbox:
        spec = spec or SandboxSpec()
        self.refuse_network(spec)
        return await self._place(spec, None)

    async def _place(self, spec: SandboxSpec, restore: _Restore | None) -> RaySandbox:
        """A session actor on the node with the most room, started (or restored from a saved
        machine: only on nodes whose backend restores machines, those known to first)."""
        await self._connect()
        usage = await self.nodes()
        if not any(node.room > 0 for node in usage):
            # The GCS's view of free slots lags their release by up to a report period: a
            # slot freed a moment ago may still look taken. Look once more before refusing.
            await asyncio.sleep(RECHECK_S)
            usage = await self.nodes()
        fits = restore is None and self._pools.fits(spec)
        candidates = [node for node in usage if node.alive and node.room > 0]
        if restore is not None:
            candidates = [n for n in candidates if self._whole_saves.get(n.node_id) is not False]
        random.shuffle(candidates)
        candidates.sort(key=lambda node: -(node.room - self._placing.get(node.node_id, 0)))
        if restore is not None:  # nodes known to restore machines first
            candidates.sort(key=lambda node: not self._whole_saves.get(node.node_id, False))
        failed: BaseException | None = None  # the last node's failure to restore the machine
        for node in candidates:
            if fits and node.warm:
                warm = await self._pools.take(node.node_id, spec)
                if warm is not None:
                    return warm
                if node.free <= 0:
                    continue  # others took its warm actors, and it has no free slot
            self._placing[node.node_id] = self._placing.get(node.node_id, 0) + 1
            placed = False
            try:
                sandbox = await self._start_on(node, spec, restore)
                placed = True
                return sandbox
            except _Unplaced:
                log.info("node %s filled before a session landed there", node.node_id[:16])
            except _CannotRestore:
                log.info("node %s does not restore whole machines", node.node_id[:16])
            except _NodeCannotRestore as exc:
                # This node could not restore it (another runsc, the kernel image missing
                # there, its worker died): the next one may.
                log.warning("node %s could not restore the machine: %s", node.node_id[:16], exc)
                failed = exc.__cause__ or exc
            finally:  # a slot filled stays counted until the GCS's view has caught up
                forget = functools.partial(self._placed_no_more, node.node_id)
                if placed:
                    asyncio.get_running_loop().call_later(GCS_LAG_S, forget)
                else:
                    forget()
        if failed is not None:
            raise failed
        if restore is not None and not any(self._whole_saves.values()):
            raise SandboxError(
                "no node of the cluster restores whole machines: the session's machine was "
                "saved on a node whose backend does (CIR_NODE_BACKEND=gvisor); start one such "
                "node at least, then resume it again (nothing of it is lost)"
            )
        now = await self.nodes() if candidates else usage
        raise CapacityReached(_full_message(now, tried=len(candidates)))

    def _placed_no_more(self, node_id: str) -> None:
        left = self._placing.get(node_id, 0) - 1
        if left > 0:
            self._placing[node_id] = left
        else:
            self._placing.pop(node_id, None)

    async def _start_on(
        self, node: NodeUsage, spec: SandboxSpec, restore: _Restore | None
    ) -> RaySandbox:
        sandbox_id = secrets.token_hex(8)
        name = session_actor_name(self.config.orchestrator_id, sandbox_id)
        if node.free <= 0 and node.warm:  # every free slot there is held warm: one back
            await self._pools.give_back(node.node_id)
        # Making a named actor is a GCS round trip: off the event loop.
        actor = await asyncio.to_thread(
            new_session_actor,
            name,
            self.config.namespace,
            node.node_id,
            sandbox_id,
            spec,
            self.config,
        )
        try:
            await self._placed_or_why(actor, node)
            if restore is None:
                facts = await start_session(actor, name)
            else:
                facts = await self._restored(actor, name, node, restore)
        except BaseException:
            await kill_actor(actor)
            raise
        self._whole_saves[node.node_id] = facts.whole_saves
        return RaySandbox(actor, name, spec, facts, self._machines)

    async def _restored(
        self, actor: Any, name: str, node: NodeUsage, restore: _Restore
    ) -> SessionFacts:
        """Carry the saved machine to the placed actor's node and start it from there."""
        try:
            placed: SessionFacts = await actor.describe.remote()
            self._whole_saves[node.node_id] = placed.whole_saves
            if not placed.whole_saves:
                raise _CannotRestore
            cap = restore.max_bytes
            token: str = await actor.receive_open.remote(cap)

            async def send(batch: list[TreeEntry]) -> None:
                await actor.receive_tree.remote(token, batch)

            await send_tree(restore.saved, max_bytes=cap, send=send)
            return await start_session(actor, name, restore=(token, restore.how))
        except (RayActorError, OSError, SandboxStartError, BackendTimeout) as exc:
            raise _NodeCannotRestore(str(exc)) from exc
        except SavedSandboxUnusable as exc:  # its engine's refusal (another runsc...) may be
            # this node's alone; what is the image's own (over its caps) holds everywhere
            raise _NodeCannotRestore(str(exc)) from exc

    async def _placed_or_why(self, actor: Any, node: NodeUsage) -> None:
        """The actor placed and made on its node; else why not: `_Unplaced` (the node filled,
        or died: the next node may take it), `SandboxStartError` (its creation failed there,
        with Ray's cause), `BackendTimeout` (a worker took it but is slow to start)."""
        where = f"node {node.node_id[:16]} ({node.address})"
        try:
            await self._placed(actor, node.node_id)
        except RayActorError as exc:
            fate = await known_fate(actor_id_of(actor))
            if not isinstance(exc, ActorDiedError) or (fate is not None and fate.node_died):
                raise _Unplaced from exc
            cause = (fate.cause if fate is not None else "") or creation_error(exc)
            raise SandboxStartError(
                f"the session actor could not be made on {where}: {cause} (is the node set up "
                "as docs/cluster.md says: the same code-interpreter and Ray as the service?)"
            ) from None
        except TimeoutError as exc:
            fate = await known_fate(actor_id_of(actor))
            if fate is not None and fate.placed:
                raise BackendTimeout(
                    f"the session actor was given a slot on {where} but did not start within "
                    f"{self.config.placement_wait_s:g} s (placement_wait_s): the node is slow or "
                    "overloaded; try again"
                ) from None
            raise _Unplaced from exc

    async def _placed(self, actor: Any, node_id: str) -> None:
        """Wait for Ray to place the actor; unplaced after `NUDGE_S`, the node's keeper (if
        any) gives a slot back, since it may have filled the one this actor aimed at."""
        wait = self.config.placement_wait_s
        placed: asyncio.Future[Any] = asyncio.ensure_future(actor.describe.remote())
        try:
            if self._pools.enabled and wait > NUDGE_S:
                done, _ = await asyncio.wait({placed}, timeout=NUDGE_S)
                if not done:
                    await self._pools.give_back(node_id)
                    wait -= NUDGE_S
            await asyncio.wait_for(asyncio.shield(placed), wait)
        finally:
            placed.cancel()

    async def attach(self, handle: str, spec: SandboxSpec) -> RaySandbox:
        """The session actor named `handle` (made by any replica of this orchestrator id);
        `SandboxLost` when it is gone (saying where it was and why, if the cluster still
        knows), `BackendUnavailable` when the cluster does not answer."""
        if not handle.startswith(session_prefix(self.config.orchestrator_id)):
            raise SandboxError(
                f"{handle!r} names no session of this service (orchestrator id "
                f"{self.config.orchestrator_id!r})"
            )
        await self._connect()
        try:
            actor = await asyncio.to_thread(ray.get_actor, handle, self.config.namespace)
        except ValueError:  # no live actor of that name (a dead one's name is released)
            raise SandboxLost(await lost_by_name(handle, self.config.namespace)) from None
        except Exception as exc:
            raise BackendUnavailable(
                f"the Ray cluster did not answer where the session {handle} is: "
                f"{short(str(exc))}; try again in a moment"
            ) from None
        try:
            facts: SessionFacts = await actor.describe.remote()
        except Exception as exc:
            error = await sandbox_error_of(exc, handle, None, actor_id_of(actor))
            raise error from None
        return RaySandbox(actor, handle, spec, facts, self._machines)

    async def wake(self, handle: str, spec: SandboxSpec) -> RaySandbox:
        """A session `RaySandbox.suspend` paused whole, running again as it was, on any node
        whose backend restores machines; its image stays in the shared store until the
        service has recorded the session running (`woken`), so a resume that fails after the
        wake can be tried again."""
        saved = self._machine_store().path(handle)
        if not await asyncio.to_thread(saved.is_dir):
            raise SandboxError(f"the paused machine {handle} is not in the shared store")
        return await self._place(spec, _Restore(saved, "wake", await _carried_cap(saved, spec)))

    async def woken(self, handle: str) -> None:
        if MachineStore.is_handle(handle) and self._machines is not None:
            await self._machines.discard(handle)

    async def fork(self, saved: Path, spec: SandboxSpec) -> RaySandbox:
        """A new session restored from a snapshot of a whole machine (`save_whole`), re-keyed,
        on any node whose backend restores machines."""
        return await self._place(spec, _Restore(saved, "fork", await _carried_cap(saved, spec)))

    def _machine_store(self) -> MachineStore:
        if self._machines is None:
            raise SandboxError(
                "this ray backend has no store of paused machines (machine_images_dir; the "
                "service sets it inside its saved_states_dir)"
            )
        return self._machines

    async def discard(self, handle: str) -> None:
        """End a session actor for good: its sandbox is closed, then its process ends. A
        paused machine's handle: its image goes from the shared store."""
        if MachineStore.is_handle(handle):
            await self._machine_store().discard(handle)
            return
        await self._connect()
        try:
            actor = await asyncio.to_thread(ray.get_actor, handle, self.config.namespace)
        except ValueError:
            return  # gone already
        except Exception as exc:
            raise BackendUnavailable(
                f"the Ray cluster did not answer where the session {handle} is: "
                f"{short(str(exc))}; try again in a moment"
            ) from None
        with contextlib.suppress(Exception):  # closing is a courtesy: the kill ends it anyway
            await asyncio.wait_for(actor.close.remote(), 60)
        await kill_actor(actor)

    async def list_sandboxes(self) -> list[str]:
        """The handles of this orchestrator's sandboxes: its live session actors' names (warm
        ones not yet claimed are the pools', not sessions, and are left out), and the paused
        whole machines waiting in the shared store (`discard` takes either)."""
        await self._connect()
        names = await asyncio.to_thread(self._named_actors)
        prefix = session_prefix(self.config.orchestrator_id)
        sessions = {name for name in names if name.startswith(prefix)}
        machines = await self._machines.stored() if self._machines is not None else []
        return sorted(sessions - await self._pools.held(names)) + machines

    async def paused_from(self, handles: set[str]) -> dict[str, str]:
        """The session actor each of these paused machines was paused from, where known: the
        orphan sweep keeps a machine whose actor a record still names."""
        if self._machines is None:
            return {}
        return await self._machines.paused_from(handles)

    async def cleanup_orphans(self) -> int:
        """Images a replica killed while carrying them into the shared store left half made
        (whole ones no record names are the orphan sweep's: `list_sandboxes`)."""
        if self._machines is None:
            return 0
        return await self._machines.remove_partials(time.time() - PARTIAL_AFTER_S)

    def _named_actors(self) -> list[str]:
        found = ray.util.list_named_actors(all_namespaces=True)
        return [
            entry["name"]
            for entry in found
            if isinstance(entry, dict) and entry.get("namespace") == self.config.namespace
        ]

    async def languages(self, spec: SandboxSpec | None = None) -> list[str]:
        return [PYTHON]

    def refuse_network(self, spec: SandboxSpec) -> None:
        if spec.network.enabled and not self.config.egress_relayed:
            raise SandboxError(
                "this ray backend's sandboxes have no network: its driver does not open their "
                "egress proxies nor take their records (RayBackendConfig.egress_relayed; the "
                f"service does); ask for network 'none' (asked: {spec.network.mode!r})"
            )

    # --- nodes ------------------------------------------------------------------------------

    async def nodes(self) -> list[NodeUsage]:
        """Every node that offers sessions (or did, and died): its slots, taken and warm.
        With a pool, each alive node's keeper is made here if it is not there yet."""
        await self._connect()
        usage = await self._usage()
        if not self._pools.enabled:
            return usage
        pools = await self._pools.states([node.node_id for node in usage if node.alive])
        return [
            replace(node, warm=len(pools[node.node_id].ready)) if node.node_id in pools else node
            for node in usage
        ]

    async def _usage(self) -> list[NodeUsage]:
        usage = await asyncio.to_thread(_node_usage, self._seen)
        for node in usage:
            if node.alive:
                self._seen.pop(node.node_id, None)
                self._seen[node.node_id] = node.capacity
        while len(self._seen) > MAX_DEAD_NODES + sum(node.alive for node in usage):
            del self._seen[next(iter(self._seen))]
        return usage

    # --- warm pools (warm_pool.py) ----------------------------------------------------------

    async def pools(self) -> list[PoolState]:
        """Each alive node's warm pool of this replica's pool spec (none: no pool)."""
        await self._connect()
        if not self._pools.enabled:
            return []
        usage = await self._usage()
        states = await self._pools.states([node.node_id for node in usage if node.alive])
        return list(states.values())

    async def drain_pools(self) -> int:
        """End every warm pool keeper of this orchestrator id (any spec, made by any replica)
        and the warm actors they hold; how many warm actors were ended. For the shutdown of
        the whole cluster, and tests: a replica's next `create` or `nodes` with a pool makes
        its keepers again."""
        await self._connect()
        names = await asyncio.to_thread(self._named_actors)
        return await self._pools.drain(names)


def _node_usage(seen: dict[str, int]) -> list[NodeUsage]:
    """Each node's slots from Ray's own books: totals from `ray.nodes()`, what is free from
    the GCS's per-node view (cluster_state.py). Alive nodes that offer sessions, and dead
    ones among those `seen` offering sessions before."""
    nodes = cluster_nodes()
    available = free_resources_per_node()
    usage = []
    for node in nodes:
        node_id = str(node.get("NodeID", ""))
        alive = bool(node.get("Alive"))
        capacity = int(node.get("Resources", {}).get(SESSION_RESOURCE, 0)) if alive else 0
        if alive and capacity <= 0:
            continue  # offers no sessions
        if not alive:
            if node_id not in seen:
                continue  # never seen offering sessions (a dead head, an old node)
            capacity = seen[node_id]
        free = int(available.get(node_id, {}).get(SESSION_RESOURCE, 0)) if alive else 0
        usage.append(
            NodeUsage(
                node_id=node_id,
                address=str(node.get("NodeManagerAddress", "?")),
                alive=alive,
                sessions=max(0, capacity - free) if alive else 0,
                capacity=capacity,
            )
        )
    return usage


def _full_message(usage: list[NodeUsage], *, tried: int = 0) -> str:
    """Why no node took the session, as the cluster's books have it now: never "full" while
    they show a free slot."""
    alive = [node for node in usage if node.alive]
    if not alive:
        return (
            "no node of the cluster offers sessions (none was started with "
            f"--resources='{{\"{SESSION_RESOURCE}\": N}}', or all of them are down); add a node"
        )
    taken = sum(node.sessions for node in alive)
    slots = sum(node.capacity for node in alive)
    if taken < slots:
        return (
            f"no node took the session: the {tried} node(s) with room filled before it could "
            f"start there (now {len(alive)} nodes, {taken} of {slots} slots taken, as the "
            "cluster last heard); try again"
        )
    return (
        f"every node of the cluster holds its maximum of sessions: {len(alive)} nodes, "
        f"{taken} of {slots} slots taken; try again later or add a node"
    )
