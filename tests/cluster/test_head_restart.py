"""The head node restarts; the sessions on the worker nodes do not notice (docs/cluster.md).

With GCS fault tolerance the head's GCS keeps its tables in Redis (`RAY_REDIS_ADDRESS`). Here: a
real redis-server, a head started with it, a worker node, and on the worker a detached named
actor (a plain one; then a session actor, its kernel holding a variable). The head is then
killed outright (every process it started, as when its pod dies) and started again on the same
GCS port with the same Redis: the actor is still found by its name and answers from the same
process with its state intact; the session's kernel still holds its variable.

The cluster is this test's own, not the shared one of conftest.py (its head is killed), launched
by sandbox/backends/ray_cluster/local_cluster.py: every Ray process on 127.0.0.1, token auth with
a token of its own, each node stopped by its own processes (never `ray stop`), and nothing of it
may outlive the test. Drivers run as subprocesses: a driver attached to the killed head's raylet
would die with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox.backends.ray_cluster.local_cluster import LocalCluster, local_cluster
from tests.cluster.redis_server import redis_server

pytestmark = pytest.mark.cluster

NAMESPACE = "cir-head-restart"
START_TIMEOUT_S = 120
WORKER_RESOURCE = "head_restart_worker"  # pins the actor to the worker node

DRIVER = f"""
import json, os, sys
import ray
from sandbox.backends.ray_cluster.loopback import keep_loopback
keep_loopback()
ray.init(address=sys.argv[1], _node_ip_address="127.0.0.1", namespace="{NAMESPACE}",
         log_to_driver=False)
if sys.argv[2] == "create":
    @ray.remote(num_cpus=0, resources={{"{WORKER_RESOURCE}": 1}}, max_restarts=0)
    class Counter:
        def __init__(self):
            self.count = 0

        def bump(self):
            self.count += 1
            node = ray.get_runtime_context().get_node_id()
            return {{"count": self.count, "pid": os.getpid(), "node": node}}

    actor = Counter.options(name="counter", lifetime="detached").remote()
else:
    actor = ray.get_actor("counter")
print(json.dumps(ray.get(actor.bump.remote(), timeout=120)))
"""


SESSION_DRIVER = f"""
import asyncio, json, sys
from code_interpreter_wire.spec import SandboxSpec
from sandbox.backends.ray_cluster.backend import RayBackend
from sandbox.backends.ray_cluster.config import RayBackendConfig

async def main():
    backend = RayBackend(RayBackendConfig(
        address=sys.argv[1], orchestrator_id="{NAMESPACE}", node_ip="127.0.0.1",
        placement_wait_s=60.0,
    ))
    try:
        if sys.argv[2] == "create":
            sandbox = await backend.create()
            await sandbox.execute("import os\\nx = 41\\npid = os.getpid()")
        else:
            sandbox = await backend.attach(sys.argv[3], SandboxSpec())
        answer = (await sandbox.execute("x + 1, pid")).text
        said = {{"handle": sandbox.handle, "node": sandbox.node_id, "answer": answer}}
        if sys.argv[2] == "end":
            await backend.discard(sandbox.handle)
    finally:
        await backend.close()
    print(json.dumps(said))

asyncio.run(main())
"""


def driver(cluster: LocalCluster, *args: str, script: str = DRIVER) -> dict[str, object]:
    """Run a driver of its own joined to the cluster (with its token); what it said last."""
    done = subprocess.run(
        [sys.executable, "-c", script, cluster.address, *args],
        env={**os.environ, **cluster.env},
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextmanager
def cluster_with_gcs_in_redis() -> Iterator[tuple[LocalCluster, Callable[[], None]]]:
    """A head whose GCS keeps its tables in a real Redis (with its password, as a deployment's
    must: docs/cluster.md) and a worker node offering a session; and what restarts the head:
    killed outright, then started again on the same GCS port with the same Redis."""
    # Redis outlives the cluster (started before it, stopped after), in a directory not the
    # cluster's: the cluster's stop ends every process naming its own directory.
    with (
        tempfile.TemporaryDirectory(prefix="cirhr-redis", dir="/tmp") as redis_dir,
        redis_server(Path(redis_dir)) as url,
        local_cluster((), prefix="cirhr") as cluster,
    ):
        redis_password, _, redis_address = url.removeprefix("redis://:").rpartition("@")
        head_env = {
            "RAY_REDIS_ADDRESS": redis_address.rsplit("/", 1)[0],
            "RAY_external_storage_namespace": "cir-head-restart",
        }
        head_options = [f"--redis-password={redis_password}"]
        head = cluster.start_node(num_cpus=0, env=head_env, options=head_options)
        worker = cluster.start_node(
            1,
            resources={WORKER_RESOURCE: 1},
            # How long the worker's raylet waits for a GCS that went away (Ray's default, 60 s,
            # said here so the test does not depend on it).
            env={"RAY_gcs_rpc_server_reconnect_timeout_s": "120"},
        )

        def restart_head() -> None:
            cluster.kill_node(head)
            assert head.pids() == set()
            # A fresh temp dir, as a new head pod has: the head's GCS port is the same.
            cluster.start_node(head=True, num_cpus=0, env=head_env, options=head_options)

        yield cluster, restart_head
        assert worker.pids(), "the worker node kept running"
        # Killed, as the head was: a graceful stop of a GCS kept in Redis would take its full
        # grace period. What outlives this is still found by local_cluster's own check.
        for node in cluster.nodes:
            cluster.kill_node(node)


def test_a_detached_actor_on_a_worker_outlives_a_head_restart() -> None:
    with cluster_with_gcs_in_redis() as (cluster, restart_head):
        before = driver(cluster, "create")
        assert before["count"] == 1
        restart_head()
        after = driver(cluster, "get")
        assert after == {"count": 2, "pid": before["pid"], "node": before["node"]}


def test_a_session_on_a_worker_outlives_a_head_restart() -> None:
    """A session actor, as the service makes it: after the restart a new driver (a replica
    started afresh) attaches to it by its handle, and its kernel answers with what it held."""
    with cluster_with_gcs_in_redis() as (cluster, restart_head):
        before = driver(cluster, "create", script=SESSION_DRIVER)
        assert str(before["answer"]).startswith("(42, ")
        restart_head()
        after = driver(cluster, "end", str(before["handle"]), script=SESSION_DRIVER)
        assert after == before  # the same actor, node and kernel process, its variable kept
