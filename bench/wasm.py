"""The wasm backend (docs/wasm.md) beside the local backend, sampled in turns: a sandbox's start
from the memory snapshot (and cold, without one), a warm pool's hand-over over HTTP, and `1+1`
through the Python API. Memory per idle session is measured by the density part's method
(bench/ours.py: `density`), with a state directory of the bench's own (`scratch`)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import httpx

from bench import first_chart, workloads
from bench.interleave import Measure, Sampled, Untimed, interleaved
from bench.ours import backend
from bench.served import API_KEY, served
from sandbox import Backend, Sandbox

LOCAL_START = "local: cold session start (beside wasm)"
LOCAL_TRIVIAL = "local: 1+1 via Python API (beside wasm)"
LOCAL_HANDOVER = "local: warm-pool hand-over over HTTP (beside wasm)"


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A state directory for the bench's wasm sandboxes (and their snapshot), removed after."""
    path = Path(tempfile.mkdtemp(prefix="cir-bench-wasm-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _start(b: Backend, after: Untimed) -> None:
    made = await b.create()
    after.later(made.close)


async def _trivial(sb: Sandbox) -> None:
    assert (await sb.execute(workloads.TRIVIAL)).text == "2"


class _Pool:
    """A service whose only backend is `name`, with a warm pool of one."""

    def __init__(self, api: httpx.AsyncClient, name: str) -> None:
        self.api, self.name = api, name
        self.handed: str | None = None

    async def full(self) -> None:
        if self.handed is not None:
            await self.api.delete(f"/v1/sessions/{self.handed}")
            self.handed = None
        await first_chart.pool_full(self.api, self.name)

    async def hand_over(self) -> None:
        r = await self.api.post("/v1/sessions", json={})
        assert r.json()["from_pool"] is True, r.text
        self.handed = r.json()["id"]


@contextlib.asynccontextmanager
async def _pool(name: str) -> AsyncIterator[_Pool]:
    settings = {"backends": name, "default_backend": name, "pool_size": "1"}
    async with (
        served(**settings) as url,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300
        ) as api,
    ):
        yield _Pool(api, name)


async def measure(quick: bool) -> dict[str, tuple[Sampled, str]]:
    """Each measure's samples and the name of its baseline."""
    starts, runs, handovers = (3, 30, 4) if quick else (8, 200, 12)
    out: dict[str, tuple[Sampled, str]] = {}
    with scratch() as where:
        local = backend("local")
        snapshot = backend("wasm", state_dir=where)
        cold = backend("wasm", state_dir=where, memory_snapshot=False)
        after = Untimed()
        try:
            await (await snapshot.create()).close()  # the snapshot taken, outside the clock
            started = await interleaved(
                {
                    LOCAL_START: Measure(partial(_start, local, after), after.settle),
                    "wasm: session start, from the memory snapshot": Measure(
                        partial(_start, snapshot, after), after.settle
                    ),
                    "wasm: session start, cold (no snapshot)": Measure(
                        partial(_start, cold, after), after.settle
                    ),
                },
                starts,
                batch=1,
                warmup=1,
            )
            await after.run()
            out |= {name: (s, LOCAL_START) for name, s in started.items()}
            async with await local.create() as on_local, await snapshot.create() as on_wasm:
                trivial = await interleaved(
                    {
                        LOCAL_TRIVIAL: Measure(partial(_trivial, on_local)),
                        "wasm: 1+1 via Python API": Measure(partial(_trivial, on_wasm)),
                    },
                    runs,
                )
            out |= {name: (s, LOCAL_TRIVIAL) for name, s in trivial.items()}
        finally:
            await after.run()
            for b in (local, snapshot, cold):
                await b.close()
        async with _pool("local") as local_pool, _pool("wasm") as wasm_pool:
            handed = await interleaved(
                {
                    LOCAL_HANDOVER: Measure(local_pool.hand_over, local_pool.full),
                    "wasm: warm-pool hand-over over HTTP": Measure(
                        wasm_pool.hand_over, wasm_pool.full
                    ),
                },
                handovers,
                batch=1,
                warmup=1,
            )
            await local_pool.full()
            await wasm_pool.full()
        out |= {name: (s, LOCAL_HANDOVER) for name, s in handed.items()}
    return out
