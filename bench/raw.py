"""The floor: jupyter_client driving a local ipykernel directly (TCP, no sandbox, no service)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import time
import weakref
from functools import partial
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from bench import raw_group, workloads
from bench.interleave import Untimed


async def start(
    kernel_name: str = "python3", specs: KernelSpecManager | None = None
) -> tuple[Any, Any]:
    """A kernel started and ready, in a CPU group weighed as our sandboxes are (raw_group.py)
    from its first import on; `specs`: where its kernel spec is, if not jupyter's own."""
    # jupyter_client picks free TCP ports, and kernels started together can race for one: one
    # start at a time, and a second try, keep the floor from failing for its own reasons.
    async with _starting:
        for attempt in range(3):
            where = {} if specs is None else {"kernel_spec_manager": specs}
            km = AsyncKernelManager(kernel_name=kernel_name, **where)
            try:
                await km.start_kernel(stderr=subprocess.DEVNULL)
            except RuntimeError:
                if attempt == 2:
                    raise
                continue
            kc = km.client()
            try:
                pid = getattr(km.provisioner, "pid", None)  # a local provisioner's process
                if pid is not None:
                    raw_group.place(pid)
                    _placed[km] = pid
                kc.start_channels()
                await kc.wait_for_ready(timeout=START_TIMEOUT_S)
            except BaseException:
                await stop(km, kc)
                raise
            return km, kc
    raise AssertionError("unreachable")


_starting = asyncio.Lock()
_placed: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # kernel -> its pid
START_TIMEOUT_S = 120.0


async def start_untimed_stop(after: Untimed) -> None:
    """A kernel started (a sample's timed part), its stop left to `after`, outside the clock."""
    km, kc = await start()
    after.later(partial(stop, km, kc))


async def stop(km: Any, kc: Any) -> None:
    kc.stop_channels()
    await km.shutdown_kernel(now=True)
    if (pid := _placed.pop(km, None)) is not None:
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
