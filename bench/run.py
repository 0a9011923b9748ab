"""`make bench`: where we stand against the kernel itself, every figure beside its baseline.

Each part samples ours and its baseline in turns (bench/interleave.py) and logs the machine's
load as it begins and ends; the default run takes about 8 minutes on a quiet 2-core machine
(15 at most), 2-3 more where the microvm backend runs; `--full` (`make bench-full`) adds the
long parts and the peers. Writes bench/results/latest.{md,json,png} (a `--quick` smoke run:
quick.*) and compares the run with the previous one of the same kind (bench/agreement.py). All
traffic stays on this machine; every sandbox, ours and the peers', runs with networking off.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from bench import (
    audit,
    cluster,
    first_chart,
    gvisor,
    languages,
    machines,
    memory,
    microvm,
    ours,
    peers,
    persistence,
    raw,
    raw_group,
    report,
    wasm,
)
from bench import latency as latency_part
from bench.interleave import Sampled, cpu_counter
from bench.latency import RAW_START, RAW_TRIVIAL
from bench.machine_load import LoadLog
from bench.stats import beside
from code_interpreter_wire.languages import LANGUAGES
from sandbox.backends.docker import DEFAULT_IMAGE
from sandbox.backends.registry import why_unavailable
from sandbox.preload import ANALYST_PRELOAD, preload_code

T = TypeVar("T")


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class Plan:
    """How much a run measures. The default takes about 8 minutes on a 2-core machine: every
    goal's figure with its baseline; `--full` adds the long parts (every language, gVisor, the
    machines, the cluster, large outputs, throughput, density at 100 sessions, peers)."""

    quick: bool
    full: bool

    @property
    def density_counts(self) -> list[int]:
        return [5] if self.quick else [10, 50, 100] if self.full else [20]

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(LANGUAGES) if self.full else ("python", "javascript", "typescript")


async def main(plan: Plan, with_peers: bool) -> dict[str, Any]:
    quick = plan.quick
    levels = [1, 4] if quick else [1, 4, 16, 64]
    seconds = 2.0 if quick else 4.0
    backends = [b for b in ("local", "docker") if why_unavailable(b) is None]
    not_run = {f"{b} backend": why for b in ("local", "docker") if (why := why_unavailable(b))}
    free = _available_bytes()
    raw_group.clear()
    load = LoadLog()
    took: dict[str, float] = {}

    async def part(name: str, work: Awaitable[T]) -> T:
        load.mark(f"{name}: start")
        began = time.monotonic()
        try:
            return await work
        finally:
            took[name] = time.monotonic() - began
            load.mark(f"{name}: end")

    samples: dict[str, list[float]] = {}
    latency: list[dict[str, Any]] = []

    def add(name: str, sampled: Sampled, baseline: str, by: dict[str, Sampled]) -> None:
        samples[name] = sampled.wall
        latency.append({"name": name, "baseline": baseline, **beside(sampled, by[baseline])})

    measured = await part("latency", latency_part.measure(latency_part.plan(quick), backends))
    by_name = {name: sampled for name, (sampled, _) in measured.items()}
    for name, (sampled, baseline) in measured.items():
        add(name, sampled, baseline, by_name)
    # The audit log's cost: 1+1 over HTTP execute with it on, as a ratio to the same with it off.
    runs = 30 if quick else 200
    audited = await part("audit", audit.on_and_off(runs))
    off, on = (
        "service: 1+1 via HTTP execute, audit off",
        "service: 1+1 via HTTP execute, audit on (ratio: to off)",
    )
    by_audit = {off: audited["off"], on: audited["on"]}
    add(off, audited["off"], off, by_audit)
    add(on, audited["on"], off, by_audit)
    # The wasm backend beside the local one: its start (from the memory snapshot, and cold), a
    # warm pool's hand-over, and 1+1.
    if (why_no_wasm := why_unavailable("wasm")) is None:
        by_wasm = await part("wasm", wasm.measure(quick))
        wasm_samples = {name: sampled for name, (sampled, _) in by_wasm.items()}
        for name, (sampled, baseline) in by_wasm.items():
            add(name, sampled, baseline, wasm_samples)
    else:
        not_run["wasm backend"] = why_no_wasm
    # gVisor: the Docker backend under runsc, each figure over the same under runc.
    if plan.full and "docker" in backends and (why_not := gvisor.why_unavailable()) is None:
        starts = 3 if quick else 10
        for measure, by_runtime in (await part("gvisor", gvisor.measure(starts, runs))).items():
            runtimes = {
                "runc": Sampled(wall=by_runtime[gvisor.RUNC]),
                "runsc": Sampled(wall=by_runtime[gvisor.RUNSC]),
            }
            add(f"docker, runc: {measure}", runtimes["runc"], "runc", runtimes)
            add(f"docker, runsc (gVisor): {measure}", runtimes["runsc"], "runc", runtimes)
    elif plan.full and "docker" in backends:
        not_run["gVisor (runsc)"] = why_not or ""

    # Each language's kernel beside the same kernel run directly (default: Python, JS, TS).
    by_language = await part(
        "languages", languages.measure(*languages.samples(quick), only=plan.languages)
    )
    # Pause, resume, snapshot, fork of a session holding ~105 MiB, beside a cold start + re-run.
    by_persistence = await part("persistence", persistence.measure(persistence.samples(quick)))
    # A fresh session's first chart over HTTP, from a warm pool with and without a preload.
    by_first_chart = await part("first chart", first_chart.measure(first_chart.samples(quick)))
    # The microvm backend on the accelerator it has here: a start restored from a template
    # beside a cold boot, in turns; pause and resume of a machine holding ~100 MiB.
    by_microvm: dict[str, Any] | None = None
    if (why_no_microvm := why_unavailable("microvm")) is None:
        by_microvm = await part("microvm", microvm.measure(microvm.samples(quick)))
    else:
        not_run["microvm backend"] = why_no_microvm
    # Memory per idle session: bare, and preloaded as a preloading pool's sessions are.
    counts = plan.density_counts
    preload = preload_code(first_chart.PRELOAD_MODULES.split(","), ANALYST_PRELOAD)
    density: dict[str, dict[str, float]] = {}
    density["raw"] = await part("density: raw", raw_density(counts))
    modules = first_chart.PRELOAD_MODULES.split(",")
    for name in backends:
        cases: list[tuple[str, str, dict[str, Any]]] = [
            (name, "", {}),
            (f"{name}, preloaded", preload, {}),
        ]
        if name in ("local", "docker") and os.geteuid() == 0:  # forking into them needs root
            zygote = {"zygote_modules": modules}
            cases.append((f"{name}, preloaded, forked from a zygote", preload, zygote))
        for label, code, config in cases:
            got = await part(f"density: {label}", ours.density(name, counts, code, **config))
            density[label] = {str(k): v for k, v in got.items()}
    if why_no_wasm is None:  # each a Deno process with Pyodide, idle, started from the snapshot
        with wasm.scratch() as where:
            got = await part("density: wasm", ours.density("wasm", counts, state_dir=where))
        density["wasm"] = {str(k): v for k, v in got.items()}
    capacity = {
        who: int(free / (by_count[str(counts[-1])] * 2**20)) for who, by_count in density.items()
    }

    by_machines: dict[str, Any] | None = None
    by_cluster: dict[str, Any] | None = None
    heavy: list[dict[str, Any]] = []
    throughput: dict[str, dict[str, float]] = {}
    peer_figures: dict[str, str] = {}
    if plan.full:
        # The gvisor backend's machines: paused and resumed whole, started from a template,
        # and a fresh session's first chart, each beside a raw kernel start of the same run.
        if (why_no_machines := why_unavailable("gvisor")) is None:
            by_machines = await part("machines", machines.measure(machines.samples(quick)))
        else:
            not_run["gvisor machines"] = why_no_machines
        # The ray backend on loopback clusters of our own: the hop, creation, 1 node beside 3.
        by_cluster = await part("cluster", cluster.measure(cluster.plan(quick)))
        heavy = await part("large outputs", asyncio.to_thread(_heavy, backends))
        throughput = await part("throughput", _throughput(backends, levels, seconds))
        if with_peers and "docker" in backends:
            starts = 3 if quick else 10
            llm = await part(
                "peers", asyncio.to_thread(peers.llm_sandbox, DEFAULT_IMAGE, starts, runs)
            )
            # Its baseline: the latency part's raw kernel (its samples were not taken in turns).
            add(
                "llm-sandbox (docker): session start",
                Sampled(wall=llm["start"]),
                RAW_START,
                by_name,
            )
            add(
                "llm-sandbox (docker): print(1+1) run",
                Sampled(wall=llm["execute"]),
                RAW_TRIVIAL,
                by_name,
            )
            peer_figures[f"llm-sandbox {llm['version']}"] = (
                "Docker backend with our kernel image, networking off; each run writes a file "
                "and starts a new Python, so it is "
                + ("stateful" if llm["stateful"] else "not stateful (x = 1, then print(x), fails)")
                + ". See the latency table."
            )
        not_run |= peers.NOT_RUNNABLE
    else:
        not_run["the long parts"] = (
            "every language, gVisor, the gvisor machines, the cluster, large outputs, "
            "throughput, density at 50 and 100 sessions and the peers run with `make bench-full`"
        )

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, "
        f"{free / 2**30:.1f} GiB free, Python {platform.python_version()})",
        "kind": "quick" if quick else "full" if plan.full else "default",
        "cpu_counter": cpu_counter(),
        "raw_weight": raw_group.where(),
        "load": load.figures(),
        "parts_s": took,
        "latency": latency,
        "samples": samples,
        "languages": by_language,
        "persistence": by_persistence,
        "first_chart": by_first_chart,
        **({"microvm": by_microvm} if by_microvm is not None else {}),
        **({"machines": by_machines} if by_machines is not None else {}),
        **({"cluster": by_cluster} if by_cluster is not None else {}),
        "heavy": heavy,
        "throughput_levels": levels if throughput else [],
        "throughput": throughput,
        "density_counts": counts,
        "density": density,
        "capacity": capacity,
        "peers": peer_figures,
        "not_run": not_run,
    }


def _heavy(backends: list[str]) -> list[dict[str, Any]]:
    out = []
    for case in ("stdout_10mb", "image_5mb"):
        base = ours.heavy_in_subprocess("raw", case)
        out.append(
            {"case": case, "who": "raw", **base, "time_ratio": "1.00x", "memory_ratio": "1.00x"}
        )
        for name in backends:
            got = ours.heavy_in_subprocess(name, case)
            out.append(
                {
                    "case": case,
                    "who": name,
                    **got,
                    "time_ratio": f"{got['seconds'] / base['seconds']:.2f}x",
                    "memory_ratio": f"{got['peak_mb'] / base['peak_mb']:.2f}x",
                }
            )
    return out


async def _throughput(
    backends: list[str], levels: list[int], seconds: float
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"raw": {}}
    for n in levels:
        out["raw"][str(n)] = await raw.throughput(n, seconds)
    for name in backends:
        out[name] = {str(n): await ours.throughput(name, n, seconds) for n in levels}
    return out


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
    parser.add_argument("--full", action="store_true", help="the long parts too")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers")
    args = parser.parse_args()
    print(report.write(asyncio.run(main(Plan(args.quick, args.full), not args.no_peers))))
