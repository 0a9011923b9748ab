"""A Ray session's egress proxy runs in its actor, on its node (node_egress.py): the session's
allow-list and the ceiling decide there, and the records of its connections wait for a poller,
each given out once (the outbox's own tests: tests/sandbox/egress/test_outbox.py). A web server
on loopback stands in for the internet (its names given by the proxy's test resolver); nothing
outside is dialled."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from code_interpreter_wire.errors import SandboxError
from code_interpreter_wire.network_policy import NetworkPolicy
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.ray_sandbox import RaySandbox
from sandbox.egress import EgressRecord, EgressSettings
from tests.cluster.conftest import RayTestCluster
from tests.cluster.test_ray_backend import _config
from tests.conftest import small_spec
from tests.network.conftest import FETCH
from tests.network.upstream import HELLO, Upstream

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CEILING = NetworkPolicy(mode="any")
# The service's ceiling takes back one of the hosts the session's policy names.
NARROWER = NetworkPolicy.model_validate({"mode": "any", "deny": ["other.test:*"]})


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
    assert await networked.open_egress(NARROWER, _settings(up.port))
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
    assert await networked.open_egress(CEILING, _settings(up.port))
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
        assert not await sandbox.open_egress(CEILING, _settings(1))
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
