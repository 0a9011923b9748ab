"""Warm pools per node of the `ray` backend (sandbox/backends/ray_cluster/warm_pool.py) on a real
loopback cluster (tests/cluster/conftest.py: a head and two nodes of 2 slots): a session that
fits is a warm actor handed over (and made what a fresh one would be), the pool refills, two
replicas taking at once never share an actor, warm actors never keep a real session out at the
cap, a pool of 0 makes nothing, a lost node takes its pool with it, and draining leaves
nothing behind (the conftest's leak check)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import ray

from code_interpreter_wire.errors import CapacityReached
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.config import RayBackendConfig
from sandbox.backends.ray_cluster.names import NAMESPACE, pool_prefix
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from sandbox.backends.ray_cluster.warm_pool import PoolState
from tests.cluster.conftest import RayTestCluster
from tests.conftest import small_spec

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
WAIT_S = 90.0  # the longest any wait for the cluster here lasts: past it the test fails

ORCHESTRATOR_ID = "pooltest"


def _config(cluster: RayTestCluster, **overrides: object) -> RayBackendConfig:
    fields: dict[str, object] = {
        "address": cluster.address,
        "orchestrator_id": ORCHESTRATOR_ID,
        "node_ip": "127.0.0.1",
        "placement_wait_s": 20.0,
        "pool_size_per_node": 1,
        "pool_spec": small_spec(),
    }
    fields.update(overrides)
    return RayBackendConfig.model_validate(fields)


@pytest.fixture(scope="module")
async def pooled(ray_cluster: RayTestCluster) -> AsyncIterator[RayBackend]:
    made = RayBackend(_config(ray_cluster))
    yield made
    await made.drain_pools()
    await made.close()


async def _full(backend: RayBackend) -> dict[str, PoolState]:
    """Wait until every alive node's pool holds its size, ready; the pools by node id."""
    deadline = time.monotonic() + WAIT_S
    while True:
        if time.monotonic() > deadline:
            pytest.fail(f"the warm pools did not fill within {WAIT_S} s")
        alive = {node.node_id for node in await backend.nodes() if node.alive}
        pools = {pool.node_id: pool for pool in await backend.pools()}
        if set(pools) == alive and all(len(p.ready) == p.size for p in pools.values()):
            return pools
        await asyncio.sleep(0.2)


def _names() -> set[str]:
    found = ray.util.list_named_actors(all_namespaces=True)
    return {entry["name"] for entry in found if entry["namespace"] == NAMESPACE}


async def test_a_session_that_fits_is_a_warm_actor_and_the_pool_refills(
    pooled: RayBackend,
) -> None:
    before = await _full(pooled)
    warm = {name for pool in before.values() for name in pool.ready}
    assert len(warm) == 2  # one per node
    assert all(node.warm == 1 for node in await pooled.nodes() if node.alive)
    assert not warm & set(await pooled.list_sandboxes())  # held warm: not sessions
    # The pool's spec but for the environment and working directory: those are set on taking.
    sandbox = await pooled.create(small_spec(env={"GREETING": "hi"}, workdir="/home/user"))
    try:
        assert sandbox.handle in warm  # handed over, not started
        assert sandbox.handle in await pooled.list_sandboxes()
        run = await sandbox.execute("import os\nos.environ['GREETING'], os.getcwd()")
        assert run.text == "('hi', '/home/user')", run
        # A warm actor is handed over once: a second hand-over finds it taken.
        actor = ray.get_actor(sandbox.handle, NAMESPACE)
        assert await actor.hand_over.remote({}, None) is None

        after = await _full(pooled)  # refilled in the background, by the keeper
        mine = after[sandbox.node_id]
        assert mine.handed_out == before[sandbox.node_id].handed_out + 1
        assert mine.ready and sandbox.handle not in mine.ready
    finally:
        await sandbox.close()


async def test_two_replicas_taking_at_once_never_share(
    pooled: RayBackend, ray_cluster: RayTestCluster
) -> None:
    other = RayBackend(_config(ray_cluster))
    made: list[RaySandbox] = []
    try:
        warm = {name for pool in (await _full(pooled)).values() for name in pool.ready}
        for _ in range(2):  # a session that does not fit on each node's free slot...
            made.append(await pooled.create(small_spec(default_timeout_s=30.0)))
        # ...leaves 2 warm (read until the GCS's view of free slots, which lags, has caught up)
        for _ in range(100):
            nodes = [node for node in await pooled.nodes() if node.alive]
            if all(node.free == 0 and node.warm == 1 for node in nodes):
                break
            await asyncio.sleep(0.2)
        assert all(node.free == 0 and node.warm == 1 for node in nodes), nodes
        # Four takers from two replicas at once, for two warm actors: each goes to one taker.
        takers = [backend.create(small_spec()) for backend in (pooled, other, pooled, other)]
        results = await asyncio.gather(*takers, return_exceptions=True)
        taken = [result for result in results if isinstance(result, RaySandbox)]
        made += taken
        assert sorted(sandbox.handle for sandbox in taken) == sorted(warm)
        assert len({sandbox.facts.pid for sandbox in taken}) == 2
        refused = [result for result in results if not isinstance(result, RaySandbox)]
        assert len(refused) == 2 and all(isinstance(r, CapacityReached) for r in refused)
        for index, sandbox in enumerate(made):
            assert (await sandbox.execute(f"{index} * 2")).text == str(index * 2)
    finally:
        await asyncio.gather(*(sandbox.close() for sandbox in made))
        await other.close()


async def test_warm_actors_never_keep_a_real_session_out(pooled: RayBackend) -> None:
    before = await _full(pooled)
    warm = {name for pool in before.values() for name in pool.ready}
    other_spec = small_spec(default_timeout_s=30.0)  # not the pool's: no warm actor fits it
    capacity = sum(node.capacity for node in await pooled.nodes() if node.alive)
    made: list[RaySandbox] = []
    try:
        for _ in range(capacity):  # the last slots are held warm: the keepers give them back
            made.append(await pooled.create(other_spec))
        assert not warm & {sandbox.handle for sandbox in made}
        nodes = [node for node in await pooled.nodes() if node.alive]
        assert all(node.warm == 0 and node.sessions == node.capacity for node in nodes)
        given_back = sum(pool.given_back for pool in await pooled.pools())
        assert given_back == sum(pool.given_back for pool in before.values()) + len(before)
        with pytest.raises(CapacityReached):
            await pooled.create(other_spec)
    finally:
        await asyncio.gather(*(sandbox.close() for sandbox in made))
    await _full(pooled)  # room again: the keepers fill it on their own


async def test_a_pool_of_zero_makes_none(ray_cluster: RayTestCluster) -> None:
    plain = RayBackend(_config(ray_cluster, orchestrator_id="nopool", pool_size_per_node=0))
    try:
        sandbox = await plain.create(small_spec())
        try:
            assert (await sandbox.execute("1 + 1")).text == "2"
            assert await plain.list_sandboxes() == [sandbox.handle]
            assert await plain.pools() == []
            assert all(node.warm == 0 for node in await plain.nodes())
            assert not {name for name in _names() if name.startswith(pool_prefix("nopool"))}
        finally:
            await sandbox.close()
    finally:
        await plain.close()


async def test_a_lost_node_takes_its_pool(pooled: RayBackend, ray_cluster: RayTestCluster) -> None:
    extra = ray_cluster.start_node(1)
    pools = await _full(pooled)  # the new node's keeper is made and fills its only slot
    lost = set(pools[extra.node_id].ready)
    assert lost
    ray_cluster.kill_node(extra.node_id)
    deadline = time.monotonic() + WAIT_S
    while any(n.alive for n in await pooled.nodes() if n.node_id == extra.node_id):
        assert time.monotonic() < deadline, "the cluster did not find the node dead"
        await asyncio.sleep(0.2)
    sandbox = await pooled.create(small_spec())
    try:
        assert sandbox.node_id != extra.node_id
        assert (await sandbox.execute("6 * 7")).text == "42"
    finally:
        await sandbox.close()
    gone = {n.node_id: n for n in await pooled.nodes()}[extra.node_id]
    assert not gone.alive and gone.warm == 0
    assert not lost & _names()
    assert not [name for name in _names() if name.endswith(extra.node_id)]  # its keeper


async def test_drain_ends_every_keeper_and_warm_actor(pooled: RayBackend) -> None:
    pools = await _full(pooled)
    warm = {name for pool in pools.values() for name in pool.ready}
    assert await pooled.drain_pools() == len(warm)
    left = _names()
    assert not warm & left
    assert not [name for name in left if name.startswith(pool_prefix(ORCHESTRATOR_ID))]
    assert await pooled.drain_pools() == 0
