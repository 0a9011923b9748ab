"""Our figures, through the Python API (local and Docker) and through the HTTP service."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from bench import workloads
from bench.memory import CGROUP_MEMORY, cgroup_pids, memory_cgroup_of, pss_of, tree_pids
from bench.raw import _count
from bench.served import API_KEY, served
from bench.stats import timed
from sandbox import Backend, Sandbox, create_backend
from sandbox.backends.docker import DockerSandbox


def backend(name: str) -> Backend:
    return create_backend(name, **({"orchestrator_id": "bench"} if name == "docker" else {}))


async def latencies(name: str, starts: int, runs: int) -> dict[str, list[float]]:
    b = backend(name)
    try:
        start_samples = []
        for _ in range(starts):
            t = time.perf_counter()
            sb = await b.create()
            start_samples.append(time.perf_counter() - t)
            await sb.close()
        async with await b.create() as sb:
            await sb.execute(workloads.FIGURE_SETUP)

            async def trivial() -> None:
                assert (await sb.execute(workloads.TRIVIAL)).text == "2"

            async def figure() -> None:
                ex = await sb.execute(workloads.FIGURE)
                assert ex.artifacts and ex.artifacts[0].data[:4] == b"\x89PNG"

            return {
                "start": start_samples,
                "execute": await timed(runs, trivial),
                "figure": await timed(max(10, runs // 10), figure),
            }
    finally:
        await b.close()


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


async def density(name: str, counts: list[int]) -> dict[int, float]:
    """Orchestrator plus sandbox memory (PSS) per idle session, in MiB."""
    b = backend(name)
    out: dict[int, float] = {}
    boxes: list[Sandbox] = []
    try:
        for count in counts:
            while len(boxes) < count:
                boxes += await asyncio.gather(
                    *(b.create() for _ in range(min(8, count - len(boxes))))
                )
            await asyncio.sleep(2)
            pids = tree_pids(os.getpid())
            for sb in boxes:
                pids += sandbox_pids(sb)
            out[count] = pss_of(sorted(set(pids))) / count / 2**20
        return out
    finally:
        await asyncio.gather(*(sb.close() for sb in boxes))
        await b.close()


async def over_http(handovers: int, runs: int) -> dict[str, list[float]]:
    settings = {"pool_size": "1", "max_sessions_per_key": str(handovers + 10)}
    async with (
        served(**settings) as url,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
        ) as api,
    ):

        async def pool_ready() -> None:
            while (await api.get("/v1/status")).json()["pools"]["local"] < 1:
                await asyncio.sleep(0.02)

        handover = []
        for _ in range(handovers):
            await pool_ready()
            t = time.perf_counter()
            r = await api.post("/v1/sessions", json={})
            handover.append(time.perf_counter() - t)
            assert r.json()["from_pool"] is True
            await api.delete(f"/v1/sessions/{r.json()['id']}")
        await pool_ready()
        sid = (await api.post("/v1/sessions", json={})).json()["id"]

        async def execute() -> None:
            r = await api.post(f"/v1/sessions/{sid}/execute", json={"code": "1+1"})
            assert r.json()["results"][0]["text"] == "2"

        async def invoke() -> None:
            r = await api.post(
                "/v1/tools/code_interpreter/invoke",
                json={"arguments": {"code": "1+1", "session_id": sid}, "call_id": "b"},
            )
            assert "[result]\n2" in r.json()["output"]["content"]

        return {
            "handover": handover,
            "execute": await timed(runs, execute),
            "invoke": await timed(runs, invoke),
        }


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
