"""A Ray session's egress proxy runs in its actor, on its node (node_egress.py): the session's
allow-list and the ceiling decide there, and the records of its connections wait for a poller,
each given out once, within a bounded outbox. A web server on loopback stands in for the
internet (its names given by the proxy's test resolver); nothing outside is dialled."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import pytest

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.node_egress import (
    MAX_REASON_CHARS,
    RECORDS_PER_POLL,
    EgressOutbox,
)
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from sandbox.egress import EgressRecord, EgressSettings
from tests.cluster.conftest import RayTestCluster
from tests.cluster.test_ray_backend import _config
from tests.conftest import small_spec
from tests.network.conftest import FETCH
from tests.network.upstream import HELLO, Upstream, upstream

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CEILING = NetworkPolicy(mode="any")


def _settings(port: int) -> EgressSettings:
    names = ("allowed.test", "other.test")
    return EgressSettings(
        private_hosts=frozenset({*(f"{n}:{port}" for n in names), f"127.0.0.1:{port}"}),
        resolve_overrides={n: ("127.0.0.1",) for n in names},
    )


@pytest.fixture(scope="module")
def up() -> Iterator[Upstream]:
    with upstream() as served:
        yield served


@pytest.fixture
async def networked(ray_cluster: RayTestCluster, up: Upstream) -> AsyncIterator[RaySandbox]:
    backend = RayBackend(_config(ray_cluster, egress_relayed=True))
    policy = NetworkPolicy.model_validate([f"allowed.test:{up.port}"])
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
    networked: RaySandbox, up: Upstream
) -> None:
    assert await networked.open_egress(CEILING, _settings(up.port))
    assert await networked.open_egress(CEILING, _settings(up.port))  # again: the same proxy
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
    assert other[0] == 403 and "allow" in other[1], other
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
    totals = await networked.egress_totals()
    assert totals is not None
    assert (totals.connections_allowed, totals.connections_refused) == (1, 2)


@pytest.mark.cluster
async def test_a_session_without_a_network_has_no_proxy(ray_cluster: RayTestCluster) -> None:
    backend = RayBackend(_config(ray_cluster, egress_relayed=True))
    sandbox = await backend.create(small_spec())
    try:
        assert not await sandbox.open_egress(CEILING, _settings(1))
        assert await sandbox.egress_totals() is None
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


def _record(reason: str = "ok") -> EgressRecord:
    return EgressRecord(0.0, "a.test", 443, "CONNECT", True, reason, None, 0, 0, 0.0)


@pytest.mark.cluster
async def test_the_outbox_is_bounded_counts_what_it_drops_and_gives_each_record_once() -> None:
    outbox = EgressOutbox(capacity=RECORDS_PER_POLL + 2)
    for i in range(RECORDS_PER_POLL + 5):
        outbox.add(_record(str(i)))
    outbox.add(_record("x" * (MAX_REASON_CHARS * 4)))  # dropped too: the outbox is full
    first = await outbox.take(0)
    assert [r.reason for r in first.records] == [str(i) for i in range(RECORDS_PER_POLL)]
    assert first.dropped == 4
    second = await outbox.take(0)
    assert [r.reason for r in second.records] == [str(RECORDS_PER_POLL), str(RECORDS_PER_POLL + 1)]
    assert second.dropped == 0
    assert (await outbox.take(0)).records == ()

    outbox.add(_record("y" * (MAX_REASON_CHARS * 4)))  # room again: kept, its reason cut
    (kept,) = (await outbox.take(0)).records
    assert len(kept.reason) <= MAX_REASON_CHARS + 3


@pytest.mark.cluster
async def test_a_poll_waits_for_a_record_and_a_close_ends_the_polls() -> None:
    outbox = EgressOutbox()
    waiting = asyncio.ensure_future(outbox.take(30))
    await asyncio.sleep(0)  # the poll is waiting
    assert not waiting.done()
    outbox.add(_record("late"))
    assert [r.reason for r in (await waiting).records] == ["late"]

    outbox.add(_record("left"))
    outbox.close()
    assert [r.reason for r in (await outbox.take(30)).records] == ["left"]  # what was left
    with pytest.raises(SandboxError, match="closed"):
        await outbox.take(30)
    assert await outbox.drained(0)
