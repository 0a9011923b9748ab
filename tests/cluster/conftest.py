"""A real multi-node Ray cluster on this machine, all of it on 127.0.0.1, for the cluster tests.

One cluster for the whole run (session scope, started when a test first asks for it): a head
that offers no sessions and two worker nodes offering a few (`cir_sessions`), launched by
sandbox/backends/ray_cluster/local_cluster.py (every address on loopback, free ports, a temp
dir per node, token authentication with the run's own token). Starting a cluster takes ~15 s
and stopping one ~10 s on two cores, so the modules share it; the test process joins it once,
as a driver (Ray reads its token once per process).

Each module gets `ray_cluster`, its own view of that cluster: a node it starts (`start_node`)
is its own, it may kill (`kill_node`) only those, and any still running at its end are stopped.
At the end of each module what it left is checked (session actors, sandbox directories,
processes the actors started, its own nodes' processes), so a leak is blamed on the module that
made it and the next module starts on a clean cluster. At the end of the run the cluster stops
by its own pids (never `ray stop`, which would stop every cluster on the machine) and nothing
of it may outlive it.

Modules that start a cluster of their own (test_head_restart.py) run before every module of
the shared one: two clusters of ours never run at once.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends.ray_cluster.local_cluster import (
    KILL_WAIT_S,
    Leftovers,
    LocalCluster,
    LocalNode,
    free_port,
    host_processes,
    local_cluster,
)
from sandbox.backends.ray_cluster.names import NAMESPACE, egress_counter_name
from tests.conftest import require_backend
from tests.network.upstream import Upstream, upstream

__all__ = ["RUN_TOKEN", "RayNode", "RayTestCluster", "actor_processes", "free_port"]

# Ray reads its authentication settings once per process, when it is first imported or used: so
# they are set here, as this directory's tests load, with a token of this run's own (never the
# user's ~/.ray/auth_token, nor another run's). The shared cluster is started with it.
RUN_TOKEN = os.environ.get("CIR_TEST_RAY_TOKEN") or secrets.token_hex(32)
os.environ["CIR_TEST_RAY_TOKEN"] = RUN_TOKEN
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = RUN_TOKEN
HEALTH_CHECK_MS = 500  # how often the head checks a raylet: a killed node is found dead soon
SHARED_CAPACITIES = (0, 2, 2)  # the head offers no sessions; two workers of 2 slots
NODE_DEATH_WAIT_S = 60.0  # how long the head may take to see a node of a module's dead
EXITING_WAIT_S = 180.0  # how long a process past the release of its memory may take to end

RayNode = LocalNode  # the name the test modules knew a node by
EGRESS_COUNT = egress_counter_name("")  # what every service's egress count's name starts with


class RayTestCluster:
    """A module's view of the shared cluster: its address, its nodes (the shared ones and the
    module's own), the environment its processes (and a service replica joining it) need."""

    def __init__(self, cluster: LocalCluster, shared: list[LocalNode]) -> None:
        self.cluster = cluster
        self.shared = shared
        self.own: list[LocalNode] = []

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def token(self) -> str:
        return self.cluster.token

    @property
    def state_dir(self) -> Path:
        return self.cluster.state_dir

    @property
    def env(self) -> dict[str, str]:
        """What every process of the cluster, and every driver, runs with."""
        return self.cluster.env

    @property
    def nodes(self) -> list[LocalNode]:
        """The head first, the shared workers, then the nodes this module started."""
        return [*self.shared, *self.own]

    def start_node(self, capacity: int) -> LocalNode:
        """Start a node of this module's own offering `capacity` sessions."""
        node = self.cluster.start_node(capacity)
        self.own.append(node)
        return node

    def node(self, node_id: str) -> LocalNode:
        return self.cluster.node(node_id)

    def kill_node(self, node_id: str) -> None:
        """Kill a node this module started, as a crash would (SIGKILL, all of it). The shared
        nodes are every module's: killing one would break the modules after this one."""
        node = self.cluster.node(node_id)
        if node not in self.own:
            raise ValueError(
                f"node {node.name} is shared by every test module: kill only a node this "
                "module started (ray_cluster.start_node)"
            )
        self.cluster.kill_node(node)

    def node_of_actor(self, name: str, namespace: str = NAMESPACE) -> str:
        """The node id a session actor runs on (asked of the actor)."""
        import ray

        actor = ray.get_actor(name, namespace)
        facts: Any = ray.get(actor.describe.remote(), timeout=60)
        node_id: str = facts.node_id
        return node_id

    def finish(self) -> tuple[list[str], Leftovers]:
        """The module's end: end the session actors it left (and name them), stop its nodes,
        wait for the head to see them gone; then what else of the module's still runs or lies
        on disk."""
        leaked = _session_actors()
        _end_actors()
        survivors: dict[int, str] = {}
        for node in self.own:
            if node.process.poll() is None:
                survivors |= {pid: f"of node {node.name}" for pid in self.cluster.stop_node(node)}
        _wait_for(lambda: not _alive_in_ray({n.node_id for n in self.own}), NODE_DEATH_WAIT_S)
        # Ending an actor ends its sandbox, but the processes may take a moment to go.
        _wait_for(lambda: not self.cluster.sandbox_processes(), KILL_WAIT_S)
        # A process whose command line is gone is past its exit's release of its memory and
        # runs nothing any more; under load the kernel may take longer to finish it (a PID
        # namespace's first process waits for every other in it to be reaped). Waited for
        # longer; one that never ends still fails the module, with its state said.
        if all(not command for command in self.cluster.sandbox_processes().values()):
            _wait_for(lambda: not self.cluster.sandbox_processes(), EXITING_WAIT_S)
        left = Leftovers(
            {
                **{pid: _described(pid, c) for pid, c in self.cluster.sandbox_processes().items()},
                **survivors,
            },
            self.cluster.sandbox_dirs(),
        )
        return leaked, left


def _described(pid: int, command: str) -> str:
    """A leftover process as it reads: its command line, or (exiting) its state and where the
    kernel holds it."""
    if command:
        return command
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return "(gone while read)"
    return f"(exiting: state {state}, waiting in {wchan or 'nothing'})"


def _wait_for(done: Callable[[], object], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.2)


def _alive_in_ray(node_ids: set[str]) -> set[str]:
    """Which of these nodes the head still counts alive."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return {n["NodeID"] for n in nodes if n["NodeID"] in node_ids and n["Alive"]}


def _session_actors() -> list[str]:
    """The actors a module must not leave: all of ours but the egress counts, which are the
    cluster's (made by the first networked session, kept for the next)."""
    return [name for name in _our_actors() if not name.startswith(EGRESS_COUNT)]


def _our_actors() -> list[str]:
    import ray

    return [
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE
    ]


def _end_actors() -> None:
    """Close whatever a failed test left (gracefully, so its sandbox goes too), then kill; the
    egress counts too, so the next module starts with none."""
    import ray

    counts_last = sorted(_our_actors(), key=lambda name: name.startswith(EGRESS_COUNT))
    for name in counts_last:  # a session closed after its count was killed would make one
        with contextlib.suppress(Exception):
            actor = ray.get_actor(name, NAMESPACE)
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=30)
            ray.kill(actor)


@pytest.fixture(scope="session")
def shared_ray_cluster() -> Iterator[LocalCluster]:
    """The run's cluster, the test process joined to it as a driver; stopped at the run's end,
    where a process or sandbox directory of it that outlived it fails the run."""
    require_backend("local")
    import ray

    from sandbox.backends.ray_cluster.loopback import keep_loopback

    with local_cluster(
        SHARED_CAPACITIES, token=RUN_TOKEN, health_check_ms=HEALTH_CHECK_MS, prefix="cir-rc-"
    ) as cluster:
        saved = {name: os.environ.get(name) for name in cluster.env}
        os.environ.update(cluster.env)
        try:
            keep_loopback()
            ray.init(
                address=cluster.address,
                _node_ip_address="127.0.0.1",
                namespace="cir-tests",
                log_to_driver=False,
                configure_logging=False,
            )
            yield cluster
        finally:
            with contextlib.suppress(Exception):
                _end_actors()
            with contextlib.suppress(Exception):
                ray.shutdown()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="module")
def ray_cluster(shared_ray_cluster: LocalCluster) -> Iterator[RayTestCluster]:
    """The module's view of the shared cluster; what the module left is checked at its end."""
    shared = shared_ray_cluster.nodes[: len(SHARED_CAPACITIES)]
    view = RayTestCluster(shared_ray_cluster, shared)
    yield view
    leaked, left = view.finish()
    assert not leaked, f"session actors outlived the module's tests: {leaked}"
    assert not left, f"the module's tests left {left}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This directory's tests that need no shared cluster first, the order otherwise kept: a
    module starting a cluster of its own never runs beside the shared one (2 cores)."""
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if here in item.path.parents]
    ordered = sorted(
        (items[i] for i in mine),
        key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()),
    )
    for i, item in zip(mine, ordered, strict=True):
        items[i] = item


def actor_processes(cluster: RayTestCluster) -> dict[int, Any]:
    """Processes of the cluster now (daemons, workers, sandboxes): pid -> command line."""
    table = host_processes()
    return {pid: table[pid].cmdline for pid in cluster.cluster.own_pids(table)}


@pytest.fixture(scope="module")
def egress_upstream() -> Iterator[Upstream]:
    """A web server on loopback standing in for the internet (tests/network/upstream.py): the
    replicas' and the tests' egress settings name it `allowed.test` and `other.test`."""
    with upstream() as served:
        yield served
