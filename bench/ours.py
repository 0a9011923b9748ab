"""Our figures through the Python API, local and Docker: large outputs, throughput, density."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench import workloads
from bench.memory import CGROUP_MEMORY, cgroup_pids, memory_cgroup_of, pss_of, tree_pids
from bench.raw import _count
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.docker import DockerSandbox


def backend(name: str, **config: Any) -> Backend:
    if name == "docker":
        config = {"orchestrator_id": "bench", **config}
    return create_backend(name, **config)


async def heavy(name: str, code: str) -> float:
    """Seconds to run `code` and hold all it returned, in a started sandbox."""
    b = backend(name)
    try:
        async with await b.create() as sb:
            t = time.perf_counter()
            ex = await sb.execute(code, timeout_s=300)
            elapsed = time.perf_counter() - t
            assert ex.ok, ex.error
            return elapsed
    finally:
        await b.close()


async def throughput(name: str, sessions: int, seconds: float) -> float:
    b = backend(name)
    try:
        boxes = await asyncio.gather(*(b.create() for _ in range(sessions)))
        try:
            return await _count(lambda i: boxes[i].execute(workloads.TRIVIAL), sessions, seconds)
        finally:
            await asyncio.gather(*(sb.close() for sb in boxes))
    finally:
        await b.close()


def sandbox_pids(sb: Sandbox) -> list[int]:
    """Every process of the sandbox: those in its cgroup and the groups below it (a Docker
    sandbox's containers sit under the sandbox's parent group), else those of its container's
    own memory cgroup, wherever the engine put it."""
    group = CGROUP_MEMORY / "code-interpreter" / sb.id
    if group.is_dir():
        return sorted(
            {pid for procs in group.rglob("cgroup.procs") for pid in cgroup_pids(procs.parent)}
        )
    if isinstance(sb, DockerSandbox):
        import docker

        container = docker.from_env().containers.get(sb.container_name)
        return cgroup_pids(CGROUP_MEMORY / memory_cgroup_of(int(container.attrs["State"]["Pid"])))
    return []


def zygote_pids(b: Any) -> list[int]:
    """A Docker backend's zygote (a container's process, not this one's child): counted."""
    zygote = getattr(b, "_zygote", None)
    container = getattr(zygote, "container", None)
    if container is None:
        return []
    container.reload()
    pid = int(container.attrs["State"].get("Pid") or 0)
    return [pid] if pid > 0 else []


async def density(
    name: str, counts: list[int], preload: str = "", **config: Any
) -> dict[int, float]:
    """Orchestrator plus sandbox memory (PSS) per idle session, in MiB; with `preload`, each
    session has run it first, as a preloading pool's do; `config`, the backend's (a zygote's
    processes, this one's children or a container's, are counted)."""
    b = backend(name, **config)
    out: dict[int, float] = {}
    boxes: list[Sandbox] = []

    async def made() -> Sandbox:
        sb = await b.create()
        try:
            if preload:
                await sb.preload(preload)
        except BaseException:
            await sb.close()
            raise
        return sb

    try:
        for count in counts:
            while len(boxes) < count:
                batch = min(4, count - len(boxes))
                got = await asyncio.gather(*(made() for _ in range(batch)), return_exceptions=True)
                boxes += [sb for sb in got if not isinstance(sb, BaseException)]
                failed = [e for e in got if isinstance(e, BaseException)]
                if failed:  # those made are closed below, with the others
                    raise failed[0]
            await asyncio.sleep(2)
            pids = tree_pids(os.getpid()) + zygote_pids(b)
            for sb in boxes:
                pids += sandbox_pids(sb)
            out[count] = pss_of(sorted(set(pids))) / count / 2**20
        return out
    finally:
        await asyncio.gather(*(sb.close() for sb in boxes))
        await b.close()


def heavy_in_subprocess(who: str, case: str, repeat: int = 3) -> dict[str, Any]:
    """Run one heavy case `repeat` times, each in a fresh process: the median wall time and the
    largest peak memory."""
    runs = []
    for _ in range(repeat):
        out = subprocess.run(
            [sys.executable, "-m", "bench.heavy", who, case],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "peak_mb": max(r["peak_mb"] for r in runs),
        "runs": repeat,
    }
