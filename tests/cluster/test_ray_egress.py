"""A Ray session's egress proxy runs in its actor, on its node (node_egress.py): the session's
allow-list and the ceiling decide there, and the records of its connections wait for a poller,
each given out once (the outbox's own tests: tests/sandbox/egress/test_outbox.py). A web server
on loopback stands in for the internet (its names given by the proxy's test resolver); nothing
outside is dialled.

The caps a key's sessions and the whole service share are counted once for the cluster
(egress_counter.py): a key's two sessions on two nodes share its cap, a node lost frees what
its sessions held, and a count restarted is told every holding again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.egress_counter import ASKS_PER_S, counter_of
from sandbox.backends.ray_cluster.names import NAMESPACE, egress_counter_name
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from sandbox.egress import EgressRecord, EgressSettings
from sandbox.egress.slots import SharedCaps
from tests.cluster.conftest import RayTestCluster
from tests.cluster.test_ray_backend import ORCHESTRATOR_ID, WAIT_S, _config, until
from tests.conftest import small_spec
from tests.network.conftest import FETCH
from tests.network.test_key_egress_cap import TUNNELS
from tests.network.upstream import HELLO, Upstream

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CEILING = NetworkPolicy(mode="any")
# The service's ceiling takes back one of the hosts the session's policy names.
NARROWER = NetworkPolicy.model_validate({"mode": "any", "deny": ["other.test:*"]})
OPEN = "HTTP/1.1 200 Connection established"


def _caps(owner: str = "alice") -> SharedCaps:
    return SharedCaps(owner, per_key=2, total=3)


def _settings(port: int) -> EgressSettings:
    names = ("allowed.test", "other.test")
    return EgressSettings(
        private_hosts=frozenset({*(f"{n}:{port}" for n in names), f"127.0.0.1:{port}"}),
        resolve_overrides={n: ("127.0.0.1",) for n in names},
    )


@pytest.fixture
async def networked(
    ray_cluster: RayTestCluster, egress_upstream: Upstream
) -> AsyncIterator[RaySandbox]:
    backend = RayBackend(_config(ray_cluster, egress_relayed=True))
    port = egress_upstream.port
    policy = NetworkPolicy.model_validate([f"allowed.test:{port}", f"other.test:{port}"])
    sandbox = await backend.create(small_spec(network=policy))
    try:
        yield sandbox
    finally:
        await sandbox.close()
        await backend.close()


async def _records(sandbox: RaySandbox, count: int) -> list[EgressRecord]:
    taken: list[EgressRecord] = []
    for _ in range(60):
        taken += (await sandbox.egress_records(1.0)).records
        if len(taken) >= count:
            return taken
    pytest.fail(f"{len(taken)} egress records came, not {count}: {taken}")


@pytest.mark.cluster
async def test_the_nodes_proxy_lets_out_only_the_allow_list_and_records_each_connection_once(
    networked: RaySandbox, egress_upstream: Upstream
) -> None:
    up = egress_upstream
    assert await networked.open_egress(NARROWER, _settings(up.port), _caps())
    seen_before = len(up.requests)
    base = f"{up.port}/hello"
    code = FETCH + (
        f"print(json.dumps([fetch('http://allowed.test:{base}'), "
        f"fetch('http://other.test:{base}'), fetch('http://127.0.0.1:{base}'), "
        f"fetch('http://127.0.0.1:{base}', proxy=False)]))"
    )
    ran = await networked.execute(code)
    assert ran.error is None, ran.error
    allowed, other, by_address, direct = json.loads(ran.stdout)
    assert allowed == [200, HELLO.decode()]
    assert other[0] == 403 and "ceiling" in other[1], other  # decided on the node
    assert by_address[0] == 403, by_address
    assert direct[0] == 0, direct  # no route out but the proxy
    assert up.requests[seen_before:] == [("GET", "/hello", f"allowed.test:{up.port}")]

    records = await _records(networked, 3)
    assert sorted((r.host, r.allowed) for r in records) == [
        ("127.0.0.1", False),
        ("allowed.test", True),
        ("other.test", False),
    ]
    assert next(r for r in records if r.allowed).bytes_down > len(HELLO)
    assert (await networked.egress_records(0)).records == ()  # each was given out once
    # Again, from any replica, with another ceiling: the same proxy, its counts and ceiling.
    assert await networked.open_egress(CEILING, _settings(up.port), _caps())
    again = await networked.execute(FETCH + f"print(fetch('http://other.test:{base}')[0])")
    assert again.stdout.strip() == "403"
    (fourth,) = await _records(networked, 1)  # recorded as its connection ended, on the node
    assert (fourth.host, fourth.allowed) == ("other.test", False)
    report = await networked.egress_report(2)
    assert report is not None
    assert (report.totals.connections_allowed, report.totals.connections_refused) == (1, 3)
    assert len(report.records) == 2  # the latest two of the node's ledger


@pytest.mark.cluster
async def test_a_session_without_a_network_has_no_proxy(ray_cluster: RayTestCluster) -> None:
    backend = RayBackend(_config(ray_cluster, egress_relayed=True))
    sandbox = await backend.create(small_spec())
    try:
        assert not await sandbox.open_egress(CEILING, _settings(1), _caps())
        assert await sandbox.egress_report(10) is None
        with pytest.raises(SandboxError, match="no egress proxy"):
            await sandbox.egress_records(0)
    finally:
        await sandbox.close()
        await backend.close()


@pytest.mark.cluster
async def test_a_backend_whose_driver_does_not_relay_egress_refuses_a_network(
    ray_cluster: RayTestCluster,
) -> None:
    backend = RayBackend(_config(ray_cluster))
    try:
        with pytest.raises(SandboxError, match="no network"):
            await backend.create(small_spec(network=NetworkPolicy(mode="any")))
    finally:
        await backend.close()


# --- the caps shared across nodes --------------------------------------------------------------


@pytest.fixture
async def counted(
    ray_cluster: RayTestCluster, egress_upstream: Upstream
) -> AsyncIterator[tuple[RayBackend, list[RaySandbox]]]:
    """A backend whose sessions (made by the test, closed here) count their connections in a
    count of the test's own, gone at the end."""
    backend = RayBackend(_config(ray_cluster, egress_relayed=True))
    made: list[RaySandbox] = []
    try:
        yield backend, made
    finally:
        for sandbox in made:
            await sandbox.close()
        await backend.close()
        await asyncio.to_thread(_end_count)


async def _session(
    backend: RayBackend,
    made: list[RaySandbox],
    up: Upstream,
    owner: str,
    caps: SharedCaps | None = None,
) -> RaySandbox:
    policy = NetworkPolicy.model_validate([f"allowed.test:{up.port}"])
    sandbox = await backend.create(small_spec(network=policy))
    made.append(sandbox)
    assert await sandbox.open_egress(CEILING, _settings(up.port), caps or _caps(owner))
    ran = await sandbox.execute(TUNNELS)
    assert ran.error is None, ran.error
    return sandbox


async def _tunnels(sandbox: RaySandbox, up: Upstream, count: int) -> list[str]:
    """The status line of each of `count` tunnels opened one after another and held."""
    authority = f"allowed.test:{up.port}"
    ran = await sandbox.execute(
        f"import json; print(json.dumps([tunnel({authority!r}) for _ in range({count})]))"
    )
    assert ran.error is None, ran.error
    lines: list[str] = json.loads(ran.stdout)
    return lines


def _count() -> Any:
    return ray.get_actor(egress_counter_name(ORCHESTRATOR_ID), NAMESPACE)


async def _counts() -> tuple[int, dict[str, int]]:
    counts: tuple[int, dict[str, int]] = await _count().counts.remote()
    return counts


def _end_count() -> None:
    """Kill the count (if any) and wait until its name is free."""
    with contextlib.suppress(ValueError):  # none was made
        ray.kill(_count(), no_restart=True)
    deadline = time.monotonic() + WAIT_S
    while any(e["name"] == egress_counter_name(ORCHESTRATOR_ID) for e in _named()):
        assert time.monotonic() < deadline, "the killed count kept its name"
        time.sleep(0.1)


def _named() -> list[dict[str, str]]:
    return [
        e
        for e in ray.util.list_named_actors(all_namespaces=True)
        if isinstance(e, dict) and e.get("namespace") == NAMESPACE
    ]


@pytest.mark.cluster
async def test_a_keys_cap_and_the_services_hold_across_nodes(
    counted: tuple[RayBackend, list[RaySandbox]], egress_upstream: Upstream
) -> None:
    backend, made = counted
    up = egress_upstream
    here = await _session(backend, made, up, "alice")
    there = await _session(backend, made, up, "alice")
    bobs = await _session(backend, made, up, "bob")
    assert here.node_id != there.node_id  # the emptiest node takes the next session
    assert await _tunnels(here, up, 2) == [OPEN, OPEN]
    (refused,) = await _tunnels(there, up, 1)  # on the other node: the key's cap is full
    assert refused.startswith("HTTP/1.1 503 too many connections: this API key's "), refused
    assert "2 connections" in refused and "egress_max_connections_per_key" in refused
    assert await _tunnels(bobs, up, 1) == [OPEN]  # another key still gets in...
    (refused,) = await _tunnels(bobs, up, 1)  # ...up to the service's cap
    assert "3 connections" in refused and "egress_max_connections_total" in refused, refused
    assert await _counts() == (3, {"alice": 2, "bob": 1})  # the refusals hold nothing

    # One of the key's tunnels closed on one node: the key's session on the other gets in.
    assert (await here.execute("_tunnels.pop().close()")).error is None
    await until(
        lambda: _counts_are((2, {"alice": 1, "bob": 1})), "the closed tunnel to be given back"
    )
    # (A session refused by a shared cap is refused without asking for half a second.)
    await until(lambda: _tunnel_opens(there, up), "the key's session on the other node")
    assert await _counts() == (3, {"alice": 2, "bob": 1})
    # A session that ends frees what it held.
    await bobs.close()
    await until(lambda: _counts_are((2, {"alice": 2})), "the ended session's slot")


async def _counts_are(expected: tuple[int, dict[str, int]]) -> bool:
    try:
        return await _counts() == expected
    except RayActorError:  # restarting
        return False


@pytest.mark.cluster
async def test_a_lost_node_frees_what_its_sessions_held_and_a_restarted_count_is_told_again(
    ray_cluster: RayTestCluster,
    counted: tuple[RayBackend, list[RaySandbox]],
    egress_upstream: Upstream,
) -> None:
    backend, made = counted
    up = egress_upstream
    await asyncio.to_thread(_end_count)  # one with a short lease: heartbeats every second
    short = await asyncio.to_thread(counter_of, ORCHESTRATOR_ID, NAMESPACE, lease_s=3.0)
    assert await short.heartbeat_s.remote() == 1.0
    kept = await _session(backend, made, up, "alice")
    extra = ray_cluster.start_node(3)  # the emptiest now: the next session lands there
    doomed = await _session(backend, made, up, "alice")
    assert doomed.node_id == extra.node_id != kept.node_id
    assert await _tunnels(doomed, up, 2) == [OPEN, OPEN]
    (refused,) = await _tunnels(kept, up, 1)
    assert "egress_max_connections_per_key" in refused, refused

    ray_cluster.kill_node(extra.node_id)
    made.remove(doomed)  # its actor died with the node
    await until(lambda: _counts_are((0, {})), "the lost node's connections to be freed")
    assert await _tunnels(kept, up, 1) == [OPEN]

    # The count itself restarted (as when it dies): it starts empty, and the sessions
    # holding connections tell it again within a heartbeat.
    first = await _count().incarnation.remote()
    ray.kill(_count(), no_restart=False)
    await until(lambda: _restarted(first), "the count to come back")
    await until(lambda: _counts_are((1, {"alice": 1})), "the holding told again")
    assert await _tunnels(kept, up, 1) == [OPEN]
    (refused,) = await _tunnels(kept, up, 1)
    assert "egress_max_connections_per_key" in refused, refused
    # What the lost session left on disk goes with the next session started on the machine.
    made.append(await backend.create(small_spec()))


async def _restarted(first: str) -> bool:
    try:
        return bool(await _count().incarnation.remote() != first)
    except RayActorError:
        return False


class HungCount:
    """Stands in for a count that never answers a take (its node overloaded, cut off)."""

    def heartbeat_s(self) -> float:
        return 1.0

    async def take(self, holder: str, caps: SharedCaps) -> None:
        await asyncio.sleep(3600)

    async def hold(self, holder: str, owner: str, count: int) -> None:
        await asyncio.sleep(3600)

    async def give_back(self, holder: str) -> None: ...

    async def drop(self, holder: str) -> None: ...


@pytest.mark.cluster
async def test_a_count_that_does_not_answer_refuses_the_connection_saying_so(
    counted: tuple[RayBackend, list[RaySandbox]], egress_upstream: Upstream
) -> None:
    backend, made = counted
    await asyncio.to_thread(_end_count)
    hung = (
        ray.remote(HungCount)
        .options(name=egress_counter_name(ORCHESTRATOR_ID), namespace=NAMESPACE, num_cpus=0)
        .remote()
    )
    assert await hung.heartbeat_s.remote() == 1.0
    sandbox = await _session(backend, made, egress_upstream, "alice")
    (refused,) = await _tunnels(sandbox, egress_upstream, 1)
    assert refused.startswith("HTTP/1.1 503 connection caps unchecked: the cluster's count"), (
        refused
    )
    assert "did not answer; retry in a moment" in refused, refused
    # The session still answers, and a count that answers again lets it out.
    await asyncio.to_thread(_end_count)
    await until(lambda: _tunnel_opens(sandbox, egress_upstream), "a count to answer again")


async def _tunnel_opens(sandbox: RaySandbox, up: Upstream) -> bool:
    return await _tunnels(sandbox, up, 1) == [OPEN]


@pytest.mark.cluster
async def test_a_sandbox_connecting_in_a_loop_asks_the_count_at_its_pace(
    counted: tuple[RayBackend, list[RaySandbox]], egress_upstream: Upstream
) -> None:
    """Each connection asks the count, so one sandbox connecting in a loop is paced: its
    asks stay within ASKS_PER_S a second (the connections past it wait their turn, served)."""
    backend, made = counted
    roomy = SharedCaps("alice", per_key=1000, total=1000)  # closed ones are given back late
    sandbox = await _session(backend, made, egress_upstream, "alice", roomy)
    assert await _tunnels(sandbox, egress_upstream, 1) == [OPEN]  # the count made
    asked_before = await _count().takes.remote()
    authority = f"allowed.test:{egress_upstream.port}"
    connections = 4 * ASKS_PER_S
    ran = await sandbox.execute(
        "import json, time\n"
        "start = time.monotonic(); lines = set()\n"
        f"for _ in range({connections}):\n"
        f"    lines.add(tunnel({authority!r})); _tunnels.pop().close()\n"
        "print(json.dumps([time.monotonic() - start, sorted(lines)]))"
    )
    assert ran.error is None, ran.error
    elapsed, lines = json.loads(ran.stdout)
    assert lines == [OPEN]  # paced, never refused
    asked = await _count().takes.remote() - asked_before
    assert asked == connections
    assert asked <= ASKS_PER_S * (elapsed + 1), (asked, elapsed)
