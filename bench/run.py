"""`make bench`: our latencies beside the raw jupyter_client floor, measured in the same run.

Absolute times on a shared machine say little, so every figure is printed with its ratio to the
raw baseline: jupyter_client driving a local ipykernel directly (TCP, no sandbox).

Measures: kernel start (raw) vs sandbox cold start (local, Docker); the `1+1` round trip (raw,
Python API on local and Docker, HTTP execute, HTTP tool invoke); the warm-pool hand-over over
HTTP. Writes bench/results/latest.{md,json}. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from jupyter_client.manager import start_new_async_kernel

from sandbox import create_backend
from sandbox.registry import why_unavailable

RESULTS = Path(__file__).parent / "results"


def summarize(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median_ms": statistics.median(ordered) * 1000,
        "p95_ms": ordered[max(0, int(len(ordered) * 0.95) - 1)] * 1000,
        "min_ms": ordered[0] * 1000,
        "max_ms": ordered[-1] * 1000,
        "stdev_ms": (statistics.stdev(ordered) if len(ordered) > 1 else 0.0) * 1000,
    }


async def timed(n: int, once: Callable[[], Awaitable[Any]], warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        await once()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - t)
    return samples


async def raw_baseline(starts: int, runs: int) -> dict[str, list[float]]:
    start_samples = []
    for _ in range(starts):
        t = time.perf_counter()
        km, kc = await start_new_async_kernel(kernel_name="python3", stderr=subprocess.DEVNULL)
        start_samples.append(time.perf_counter() - t)
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    km, kc = await start_new_async_kernel(kernel_name="python3", stderr=subprocess.DEVNULL)
    try:

        async def once() -> None:
            reply = await kc.execute_interactive("1+1", output_hook=lambda msg: None, timeout=30)
            assert reply["content"]["status"] == "ok"

        exec_samples = await timed(runs, once)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel(now=True)
    return {"start": start_samples, "execute": exec_samples}


async def sandbox_figures(name: str, starts: int, runs: int) -> dict[str, list[float]]:
    backend = create_backend(name, **({"orchestrator_id": "bench"} if name == "docker" else {}))
    try:
        start_samples = []
        for _ in range(starts):
            t = time.perf_counter()
            sb = await backend.create()
            start_samples.append(time.perf_counter() - t)
            await sb.close()
        async with await backend.create() as sb:

            async def once() -> None:
                ex = await sb.execute("1+1")
                assert ex.text == "2"

            exec_samples = await timed(runs, once)
        return {"start": start_samples, "execute": exec_samples}
    finally:
        await backend.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def service_figures(handovers: int, runs: int) -> dict[str, list[float]]:
    root = Path(tempfile.mkdtemp(prefix="cir-bench-", dir="/tmp"))
    root.chmod(0o711)
    port = free_port()
    env = {
        **os.environ,
        "CODE_INTERPRETER_API_KEYS": "bench",
        "CODE_INTERPRETER_POOL_SIZE": "1",
        "CODE_INTERPRETER_STATE_DIR": str(root / "state"),
        "CODE_INTERPRETER_MAX_SESSIONS_PER_KEY": str(handovers + 10),
    }
    server = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "orchestrator", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": "Bearer bench"}, timeout=60
        ) as api:
            for _ in range(300):
                try:
                    if (await api.get("/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)

            async def pool_ready() -> None:
                while (await api.get("/healthz")).json()["pools"]["local"] < 1:
                    await asyncio.sleep(0.02)

            handover_samples = []
            for _ in range(handovers):
                await pool_ready()
                t = time.perf_counter()
                r = await api.post("/v1/sessions", json={})
                handover_samples.append(time.perf_counter() - t)
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
                "handover": handover_samples,
                "execute": await timed(runs, execute),
                "invoke": await timed(runs, invoke),
            }
    finally:
        server.send_signal(signal.SIGTERM)
        await asyncio.wait_for(server.wait(), 60)
        shutil.rmtree(root, ignore_errors=True)


def render(report: dict[str, Any]) -> str:
    rows = report["rows"]
    lines = [
        f"# Benchmark: {report['date']} on {report['machine']}",
        "",
        "Each figure beside the raw jupyter_client baseline measured in the same run; "
        "ratio = ours / baseline (median).",
        "",
        "| measure | median ms | p95 ms | stdev ms | n | baseline | baseline median ms | ratio |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        s = row["stats"]
        lines.append(
            f"| {row['name']} | {s['median_ms']:.2f} | {s['p95_ms']:.2f} | {s['stdev_ms']:.2f} | "
            f"{s['n']} | {row['baseline']} | {row['baseline_median_ms']:.2f} | "
            f"{row['ratio']:.2f}x |"
        )
    if report["skipped"]:
        lines += ["", *[f"- not measured: {why}" for why in report["skipped"]]]
    return "\n".join(lines) + "\n"


async def main(quick: bool) -> dict[str, Any]:
    starts, runs = (3, 30) if quick else (10, 200)
    raw = await raw_baseline(starts, runs)
    baselines = {
        "raw kernel start": summarize(raw["start"]),
        "raw 1+1 round trip": summarize(raw["execute"]),
    }
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []

    def add(name: str, samples: list[float], baseline: str) -> None:
        stats = summarize(samples)
        base = baselines[baseline]["median_ms"]
        rows.append(
            {
                "name": name,
                "stats": stats,
                "baseline": baseline,
                "baseline_median_ms": base,
                "ratio": stats["median_ms"] / base,
            }
        )

    add("raw kernel start", raw["start"], "raw kernel start")
    add("raw 1+1 round trip", raw["execute"], "raw 1+1 round trip")
    for name in ("local", "docker"):
        why = why_unavailable(name)
        if why:
            skipped.append(f"{name}: {why}")
            continue
        figures = await sandbox_figures(name, starts, runs)
        add(f"{name} cold session start", figures["start"], "raw kernel start")
        add(f"{name} 1+1 via Python API", figures["execute"], "raw 1+1 round trip")
    service = await service_figures(starts * 2, runs)
    add("warm-pool hand-over (HTTP create)", service["handover"], "raw 1+1 round trip")
    add("local 1+1 via HTTP execute", service["execute"], "raw 1+1 round trip")
    add("local 1+1 via HTTP tool invoke", service["invoke"], "raw 1+1 round trip")
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()})",
        "baselines": baselines,
        "rows": rows,
        "skipped": skipped,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, for a smoke run")
    args = parser.parse_args()
    report = asyncio.run(main(args.quick))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render(report)
    (RESULTS / "latest.md").write_text(markdown)
    print(markdown)
