"""`make bench`: where we stand against the kernel itself and against peers, in one run.

Writes bench/results/latest.{md,json,png}. All traffic stays on this machine; every sandbox,
ours and the peers', runs with networking off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import (
    audit,
    cluster,
    commands,
    first_chart,
    gvisor,
    languages,
    machines,
    memory,
    ours,
    peers,
    persistence,
    raw,
    report,
)
from bench.stats import summarize
from sandbox.backends.docker import DEFAULT_IMAGE
from sandbox.backends.registry import why_unavailable


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


async def main(quick: bool, with_peers: bool) -> dict[str, Any]:
    starts, runs = (3, 30) if quick else (10, 200)
    levels = [1, 4] if quick else [1, 4, 16, 64]
    counts = [5, 10] if quick else [10, 50, 100]
    seconds = 2.0 if quick else 4.0
    backends = [b for b in ("local", "docker") if why_unavailable(b) is None]
    not_run = {f"{b} backend": why for b in ("local", "docker") if (why := why_unavailable(b))}
    free = _available_bytes()

    samples: dict[str, list[float]] = {}
    latency: list[dict[str, Any]] = []

    def add(name: str, values: list[float], baseline: str) -> None:
        samples[name] = values
        stats = summarize(values)
        base = summarize(samples[baseline])["median_ms"]
        latency.append(
            {
                "name": name,
                "stats": stats,
                "baseline": baseline,
                "baseline_median_ms": base,
                "ratio": stats["median_ms"] / base,
            }
        )

    floor = await raw.latencies(starts, runs)
    add("raw: kernel start", floor["start"], "raw: kernel start")
    add("raw: 1+1 round trip", floor["execute"], "raw: 1+1 round trip")
    add(
        "raw: matplotlib figure, PNG in hand",
        floor["figure"],
        "raw: matplotlib figure, PNG in hand",
    )
    for name in backends:
        mine = await ours.latencies(name, starts, runs)
        add(f"{name}: cold session start", mine["start"], "raw: kernel start")
        add(f"{name}: 1+1 via Python API", mine["execute"], "raw: 1+1 round trip")
        add(
            f"{name}: matplotlib figure, PNG in hand",
            mine["figure"],
            "raw: matplotlib figure, PNG in hand",
        )
    # gVisor: the Docker backend under runsc, each figure over the same under runc.
    if "docker" in backends and (why_not := gvisor.why_unavailable()) is None:
        for measure, by_runtime in (await gvisor.measure(starts, runs)).items():
            under_runc = f"docker, runc: {measure}"
            add(under_runc, by_runtime[gvisor.RUNC], under_runc)
            add(f"docker, runsc (gVisor): {measure}", by_runtime[gvisor.RUNSC], under_runc)
    elif "docker" in backends:
        not_run["gVisor (runsc)"] = why_not or ""
    http = await ours.over_http(starts * 2, runs)
    add("service: warm-pool hand-over (HTTP)", http["handover"], "raw: 1+1 round trip")
    add("service: 1+1 via HTTP execute", http["execute"], "raw: 1+1 round trip")
    add("service: 1+1 via HTTP tool invoke", http["invoke"], "raw: 1+1 round trip")
    # The audit log's cost: 1+1 over HTTP execute with it on, as a ratio to the same with it off.
    logged = await audit.on_and_off(runs)
    add("service: 1+1 via HTTP execute, audit off", logged["off"], "raw: 1+1 round trip")
    off = "service: 1+1 via HTTP execute, audit off"
    add("service: 1+1 via HTTP execute, audit on (ratio: to off)", logged["on"], off)

    # Every other language's kernel beside Python's, each against the same kernel run directly.
    by_language = await languages.measure(*languages.samples(quick))
    # Pause, resume, snapshot, fork of a session holding ~105 MiB, beside a cold start + re-run.
    by_persistence = await persistence.measure(persistence.samples(quick))
    # The gvisor backend's machines: paused and resumed whole, started from a template, and a
    # fresh session's first chart, each beside a raw kernel start of the same run.
    # A fresh session's first chart over HTTP, from a warm pool with and without a preload.
    by_first_chart = await first_chart.measure(first_chart.samples(quick))
    by_machines: dict[str, Any] | None = None
    if (why_no_machines := why_unavailable("gvisor")) is None:
        by_machines = await machines.measure(machines.samples(quick))
    else:
        not_run["gvisor machines"] = why_no_machines
    # The ray backend on loopback clusters of our own: the hop, creation, 1 node beside 3.
    by_cluster = await cluster.measure(cluster.plan(quick))

    # Commands beside the kernel, each beside a plain subprocess (`docker exec` shown beside).
    add(
        "raw: echo hi, a subprocess",
        await commands.subprocess_floor(runs),
        "raw: echo hi, a subprocess",
    )
    if "docker" in backends:
        floor_exec = await commands.docker_exec_floor(runs)
        add("raw: echo hi, docker exec", floor_exec, "raw: echo hi, docker exec")
    for name in backends:  # the goal is a plain subprocess's cost, whatever the wall
        mine_echo = await commands.through_the_sandbox(name, runs)
        add(f"{name}: echo hi via Python API", mine_echo, "raw: echo hi, a subprocess")
    served = await commands.through_the_service(runs)
    add("service: echo hi via HTTP", served["http"], "raw: echo hi, a subprocess")
    add("service: echo hi via E2B SDK", served["e2b"], "raw: echo hi, a subprocess")

    peer_figures: dict[str, str] = {}
    if with_peers and "docker" in backends:
        llm = peers.llm_sandbox(DEFAULT_IMAGE, starts, runs)
        add("llm-sandbox (docker): session start", llm["start"], "raw: kernel start")
        add("llm-sandbox (docker): print(1+1) run", llm["execute"], "raw: 1+1 round trip")
        peer_figures[f"llm-sandbox {llm['version']}"] = (
            "Docker backend with our kernel image, networking off; each run writes a file and "
            "starts a new Python, so it is "
            + ("stateful" if llm["stateful"] else "not stateful (x = 1, then print(x), fails)")
            + ". See the latency table."
        )
    not_run |= peers.NOT_RUNNABLE

    heavy = []
    for case in ("stdout_10mb", "image_5mb"):
        base = ours.heavy_in_subprocess("raw", case)
        heavy.append(
            {"case": case, "who": "raw", **base, "time_ratio": "1.00x", "memory_ratio": "1.00x"}
        )
        for name in backends:
            got = ours.heavy_in_subprocess(name, case)
            heavy.append(
                {
                    "case": case,
                    "who": name,
                    **got,
                    "time_ratio": f"{got['seconds'] / base['seconds']:.2f}x",
                    "memory_ratio": f"{got['peak_mb'] / base['peak_mb']:.2f}x",
                }
            )

    throughput: dict[str, dict[str, float]] = {"raw": {}}
    for n in levels:
        throughput["raw"][str(n)] = await raw.throughput(n, seconds)
    for name in backends:
        throughput[name] = {str(n): await ours.throughput(name, n, seconds) for n in levels}

    density: dict[str, dict[str, float]] = {"raw": await raw_density(counts)}
    for name in backends:
        density[name] = {str(k): v for k, v in (await ours.density(name, counts)).items()}
    capacity = {
        who: int(free / (by_count[str(counts[-1])] * 2**20)) for who, by_count in density.items()
    }
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, "
        f"{free / 2**30:.1f} GiB free, Python {platform.python_version()})",
        "latency": latency,
        "samples": samples,
        "languages": by_language,
        "persistence": by_persistence,
        "first_chart": by_first_chart,
        **({"machines": by_machines} if by_machines is not None else {}),
        "cluster": by_cluster,
        "heavy": heavy,
        "throughput_levels": levels,
        "throughput": throughput,
        "density_counts": counts,
        "density": density,
        "capacity": capacity,
        "peers": peer_figures,
        "not_run": not_run,
    }


async def raw_density(counts: list[int]) -> dict[str, float]:
    kernels: list[Any] = []
    out: dict[str, float] = {}
    try:
        for count in counts:
            while len(kernels) < count:
                kernels += await asyncio.gather(
                    *(raw.start() for _ in range(min(8, count - len(kernels))))
                )
            await asyncio.sleep(2)
            pids = memory.tree_pids(os.getpid())
            out[str(count)] = memory.pss_of(sorted(set(pids))) / count / 2**20
        return out
    finally:
        await asyncio.gather(*(raw.stop(km, kc) for km, kc in kernels))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers")
    args = parser.parse_args()
    print(report.write(asyncio.run(main(args.quick, not args.no_peers))))
