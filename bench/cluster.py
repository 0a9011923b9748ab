"""What cluster mode costs: the Ray hop, session creation on a cluster, and one node beside three.

Measured in one run, every Ray process on 127.0.0.1 and ours alone (clusters started and stopped
here, one at a time, by their own pids; never `ray stop`):
- `1+1` through the hop: a `RaySandbox` of `create_backend("ray", ...)` on a 3-node loopback
  cluster, beside the same call on a sandbox of `create_backend("local")` (no Ray), as a ratio
  of medians;
- session creation on that cluster: `RayBackend.create()` until the new sandbox answers `1+1`,
  warm pool off; then with a warm pool of one per node (`pool_size_per_node`), each sample
  taken once the pool is full again; if the backend keeps no warm actor, said so, not measured;
- throughput: a closed loop (N sessions, each running `1+1` again and again for a fixed time),
  executions per second on a 1-node cluster and on a 3-node cluster (the local backend's figure
  beside them), and the ratio of three nodes to one. On a machine of few cores the raylets share
  them: the ratio shows what the hop and the placement cost, not how the cluster scales.

Ray's token authentication is on (`RAY_AUTH_MODE=token`) with a token of this run's own, in the
environment of every node and of this process (never ~/.ray/auth_token).

`python -m bench.cluster [--quick]` runs this part alone, prints its table and writes
bench/results/cluster.{md,json}; `make bench-full` includes it in bench/results/latest.*.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench import workloads
from bench.part_results import save_part
from bench.raw import _count
from bench.stats import summarize, timed
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.ray_cluster.local_cluster import LocalCluster, local_cluster, new_token
from sandbox.backends.ray_cluster.names import pool_prefix
from sandbox.backends.registry import why_unavailable

if TYPE_CHECKING:  # Ray is imported once this run's token is in the environment, not before
    from sandbox.backends.ray_cluster.backend import RayBackend

ORCHESTRATOR_ID = "bench"
NODE_START_TIMEOUT_S = 180.0
POOL_WAIT_S = 60.0  # how long a warm pool may take to fill before it counts as not kept
LOCAL = "local, direct: 1+1"
HOP = "ray, 3 nodes: 1+1 through the hop"
COLD = "create until 1+1, warm pool off"
WARM = "create until 1+1, warm pool of 1 per node"
THROUGHPUT_WHO = ("local, direct", "ray, 1 node", "ray, 3 nodes")


@dataclass(frozen=True)
class Plan:
    """How much to measure: `--quick` is a smoke run."""

    runs: int  # 1+1 round trips per side
    creations: int  # sessions created per creation measure
    sessions: int  # concurrent sessions of the closed loop
    seconds: float  # how long the closed loop runs


def plan(quick: bool) -> Plan:
    return Plan(30, 3, 3, 3.0) if quick else Plan(200, 10, 6, 10.0)


# --- this run's token (its clusters: sandbox/backends/ray_cluster/local_cluster.py) ---------


@contextlib.contextmanager
def run_token() -> Iterator[str]:
    """This run's Ray token, in this process's environment while the clusters run (Ray reads
    it when this process joins a cluster); the environment as it was afterwards."""
    token = new_token()
    names = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        yield token
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- the measures ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def ray_backend(
    cluster: LocalCluster, nodes: int, pool: int = 0
) -> AsyncIterator[RayBackend]:
    """The ray backend joined to `cluster`, once all its `nodes` offer sessions."""
    from sandbox.backends.ray_cluster.backend import RayBackend

    backend = create_backend(
        "ray",
        address=cluster.address,
        orchestrator_id=ORCHESTRATOR_ID,
        node_ip="127.0.0.1",
        pool_size_per_node=pool,
    )
    assert isinstance(backend, RayBackend)
    try:
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while sum(node.alive for node in await backend.nodes()) < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster's {nodes} nodes did not all join")
            await asyncio.sleep(0.2)
        yield backend
    finally:
        with contextlib.suppress(Exception):
            await end_actors(backend)
        await backend.close()


async def end_actors(backend: RayBackend) -> None:
    """End every actor of the namespace (the cluster is ours alone): a measure that failed
    leaves none behind, nor does a warm pool. Pool keepers first, so none refills."""
    import ray

    found = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
    names = [
        entry["name"]
        for entry in found
        if isinstance(entry, dict) and entry.get("namespace") == backend.config.namespace
    ]
    keepers = pool_prefix(ORCHESTRATOR_ID)
    for name in sorted(names, key=lambda name: not name.startswith(keepers)):
        await backend.discard(name)


async def round_trips(backend: Backend, runs: int) -> list[float]:
    """Seconds per `1+1`, on one sandbox of `backend`."""
    async with await backend.create() as sb:

        async def trivial() -> None:
            assert (await sb.execute(workloads.TRIVIAL)).text == "2"

        return await timed(runs, trivial)


async def creations(backend: RayBackend, n: int, warm_per_node: int) -> list[float]:
    """Seconds from `create()` until the new sandbox answers `1+1`; with a warm pool, each
    sample once every node's pool is full again."""
    out = []
    for _ in range(n):
        if warm_per_node:
            await pool_filled(backend, warm_per_node, POOL_WAIT_S)
        t = time.perf_counter()
        sb = await backend.create()
        try:
            assert (await sb.execute(workloads.TRIVIAL)).text == "2"
            out.append(time.perf_counter() - t)
        finally:
            await sb.close()
    return out


async def pool_filled(backend: RayBackend, warm_per_node: int, wait_s: float) -> bool:
    """Whether every node holds `warm_per_node` warm actors within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        usage = [node for node in await backend.nodes() if node.alive]
        if usage and all(node.warm >= warm_per_node for node in usage):
            return True
        await asyncio.sleep(0.2)
    return False


async def closed_loop(backend: Backend, sessions: int, seconds: float) -> float:
    """Executions per second: `sessions` sandboxes each running `1+1` in turn for `seconds`."""
    boxes: list[Sandbox] = []
    try:
        for _ in range(sessions):  # one at a time: placement reads the nodes' free slots
            boxes.append(await backend.create())
        for sb in boxes:  # every kernel started before the clock does
            assert (await sb.execute(workloads.TRIVIAL)).text == "2"
        return await _count(lambda i: boxes[i].execute(workloads.TRIVIAL), sessions, seconds)
    finally:
        await asyncio.gather(*(sb.close() for sb in boxes))


async def measure(p: Plan) -> dict[str, Any]:
    """Every figure of this part; the ones that cannot run here are named with the reason."""
    not_run = {
        f"{name} backend": why for name in ("local", "ray") if (why := why_unavailable(name))
    }
    if not_run:
        return figures_of({}, {}, {}, p, not_run)
    latency: dict[str, list[float]] = {}
    creation: dict[str, list[float]] = {}
    per_second: dict[str, float] = {}
    capacity = p.sessions + 2  # a node holds the whole loop, its warm actor beside it

    local = create_backend("local")
    try:
        latency[LOCAL] = await round_trips(local, p.runs)
        per_second[THROUGHPUT_WHO[0]] = await closed_loop(local, p.sessions, p.seconds)
    finally:
        await local.close()

    with run_token() as token:
        with local_cluster([capacity] * 3, token=token, prefix="cir-bc-") as cluster:
            async with ray_backend(cluster, 3) as ray:
                latency[HOP] = await round_trips(ray, p.runs)
                creation[COLD] = await creations(ray, p.creations, 0)
                per_second[THROUGHPUT_WHO[2]] = await closed_loop(ray, p.sessions, p.seconds)
            async with ray_backend(cluster, 3, pool=1) as pooled:
                await creations(pooled, 1, 0)  # whatever starts the pools has started
                if await pool_filled(pooled, 1, POOL_WAIT_S):
                    creation[WARM] = await creations(pooled, p.creations, 1)
                else:
                    not_run[WARM] = (
                        "the ray backend keeps no warm actor yet: with pool_size_per_node=1, "
                        f"no node reported one within {POOL_WAIT_S:.0f} s"
                    )
        with local_cluster([capacity], token=token, prefix="cir-bc-") as cluster:
            async with ray_backend(cluster, 1) as ray:
                per_second[THROUGHPUT_WHO[1]] = await closed_loop(ray, p.sessions, p.seconds)
    return figures_of(latency, creation, per_second, p, not_run)


# --- the figures and their report (pure) ----------------------------------------------------


def figures_of(
    latency: dict[str, list[float]],
    creation: dict[str, list[float]],
    per_second: dict[str, float],
    p: Plan,
    not_run: dict[str, str],
) -> dict[str, Any]:
    """The figures as the report keeps them: `1+1` through the hop over the local backend's
    (medians), creation p50/p95, throughput of each and three nodes over one."""
    rows = []
    if LOCAL in latency and HOP in latency:
        base = summarize(latency[LOCAL])["median_ms"]
        for name in (LOCAL, HOP):
            stats = summarize(latency[name])
            rows.append(
                {
                    "name": name,
                    "stats": stats,
                    "samples": latency[name],
                    "baseline": LOCAL,
                    "baseline_median_ms": base,
                    "ratio": stats["median_ms"] / base,
                }
            )
    one, three = per_second.get(THROUGHPUT_WHO[1]), per_second.get(THROUGHPUT_WHO[2])
    return {
        "cores": os.cpu_count(),
        "load_average": os.getloadavg()[0],  # as the figures were summed up: others' work too
        "plan": {"runs": p.runs, "creations": p.creations},
        "latency": rows,
        "creation": [
            {"name": name, "stats": summarize(values), "samples": values}
            for name, values in creation.items()
        ],
        "throughput": {
            "sessions": p.sessions,
            "seconds": p.seconds,
            "per_second": {who: per_second[who] for who in THROUGHPUT_WHO if who in per_second},
            "three_nodes_over_one": three / one if one and three is not None else None,
        },
        "not_run": not_run,
    }


def section(figures: dict[str, Any]) -> list[str]:
    """The report's section on cluster mode, as markdown lines."""
    cores = figures["cores"]
    out = [
        "## Cluster mode (the ray backend on a loopback Ray cluster)",
        "",
        "Every node a raylet of ours on 127.0.0.1 offering sessions, token auth on. `1+1` "
        "through the hop: a `RaySandbox` on a 3-node cluster beside a sandbox of the local "
        "backend (no Ray), same run; ratio = ray / local, medians.",
        "",
        "| measure | median ms | p95 ms | stdev ms | n | local median ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in figures["latency"]:
        s = row["stats"]
        out.append(
            f"| {row['name']} | {s['median_ms']:.2f} | {s['p95_ms']:.2f} | {s['stdev_ms']:.2f} "
            f"| {s['n']} | {row['baseline_median_ms']:.2f} | {row['ratio']:.2f}x |"
        )
    out += [
        "",
        "Session creation on the 3-node cluster: `RayBackend.create()` until the sandbox "
        "answers `1+1`, then closed; with a warm pool, each sample once every node's pool is "
        "full again. Of few samples, p95 is the largest.",
        "",
        "| measure | p50 ms | p95 ms | min ms | max ms | n |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in figures["creation"]:
        s = row["stats"]
        out.append(
            f"| {row['name']} | {s['median_ms']:.0f} | {s['p95_ms']:.0f} | {s['min_ms']:.0f} "
            f"| {s['max_ms']:.0f} | {s['n']} |"
        )
    loop = figures["throughput"]
    ratio = loop["three_nodes_over_one"]
    out += [
        "",
        f"Throughput: a closed loop of {loop['sessions']} sessions, each running `1+1` again "
        f"and again for {loop['seconds']:g} s; executions per second, all sessions together.",
        "",
        "| who | executions/s |",
        "|---|---:|",
    ]
    for who, value in loop["per_second"].items():
        out.append(f"| {who} | {value:.0f} |")
    if ratio is not None:
        out += [
            "",
            f"**3 nodes / 1 node: {ratio:.2f}x, on {cores} cores.** The three raylets share "
            f"this machine's {cores} cores: three nodes on one machine cannot triple anything, "
            "so this shows what the hop and the placement cost, not how a cluster of machines "
            "scales.",
        ]
    out += [
        "",
        f"Load average (1 min) as the run ended: {figures['load_average']:.2f}; whatever else "
        "runs on the machine shares its cores with these figures.",
    ]
    if figures["not_run"]:
        out.append("")
    for what, why in figures["not_run"].items():
        out.append(f"- **{what}**: not run: {why}.")
    return [*out, ""]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, a shorter loop")
    args = parser.parse_args()
    figures = asyncio.run(measure(plan(args.quick)))
    save_part("cluster", figures, section(figures))
