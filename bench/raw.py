"""The floor: jupyter_client driving a local ipykernel directly (TCP, no sandbox, no service)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import time
from functools import partial
from typing import Any

from jupyter_client.manager import start_new_async_kernel

from bench import raw_group, workloads
from bench.interleave import Untimed


async def start() -> tuple[Any, Any]:
    # jupyter_client picks free TCP ports, and kernels started together can race for one: one
    # start at a time, and a second try, keep the floor from failing for its own reasons.
    async with _starting:
        for attempt in range(3):
            try:
                km, kc = await start_new_async_kernel(
                    kernel_name="python3", stderr=subprocess.DEVNULL
                )
            except RuntimeError:
                if attempt == 2:
                    raise
                continue
            place(km)
            return km, kc
    raise AssertionError("unreachable")


def place(km: Any) -> None:
    """The kernel into a CPU group weighed as our sandboxes are (raw_group.py)."""
    pid = km.provisioner.pid if km.provisioner is not None else None
    if pid is not None:
        raw_group.place(pid)
        km.bench_pid = pid


_starting = asyncio.Lock()


async def start_untimed_stop(after: Untimed) -> None:
    """A kernel started (a sample's timed part), its stop left to `after`, outside the clock."""
    km, kc = await start()
    after.later(partial(stop, km, kc))


async def stop(km: Any, kc: Any) -> None:
    kc.stop_channels()
    await km.shutdown_kernel(now=True)
    if (pid := getattr(km, "bench_pid", None)) is not None:
        await asyncio.to_thread(raw_group.release, pid)


async def run(kc: Any, code: str) -> dict[str, Any]:
    """Execute and gather what came back: stdout length and the PNG bytes."""
    got: dict[str, Any] = {"stdout": 0, "png": []}

    def hook(msg: dict[str, Any]) -> None:
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            got["stdout"] += len(content["text"])
        elif kind in ("display_data", "execute_result") and "image/png" in content["data"]:
            got["png"].append(base64.b64decode(content["data"]["image/png"]))

    reply = await kc.execute_interactive(code, output_hook=hook, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    return got


async def heavy(code: str) -> float:
    """Seconds to run `code` and hold all it returned, on a started kernel."""
    km, kc = await start()
    try:
        t = time.perf_counter()
        await run(kc, code)
        return time.perf_counter() - t
    finally:
        await stop(km, kc)


async def throughput(sessions: int, seconds: float) -> float:
    kernels = await asyncio.gather(*(start() for _ in range(sessions)))
    try:
        return await _count(lambda i: run(kernels[i][1], workloads.TRIVIAL), sessions, seconds)
    finally:
        await asyncio.gather(*(stop(km, kc) for km, kc in kernels))


async def _count(call: Any, sessions: int, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call(i)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(sessions)))
    return done / (time.perf_counter() - started)
