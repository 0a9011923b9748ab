"""A fresh session to its first chart, as an agent sees it, on the local and Docker backends.

Over HTTP against the service with a warm pool of one: a session created (handed over from
the pool, inside the clock), a 0.5 MB CSV uploaded, a cell that reads it with pandas and plots
it with matplotlib, the PNG in hand. Twice: with the pool as it was (no preload), and with the
pool preloading the analyst stack (`preload_modules` and sandbox/preload.py's warm-up). Before
each sample every pool is full again, so every session comes from one. Beside them, in turns
with them: a raw jupyter_client kernel's start (the ratio's baseline) and a raw kernel's start
plus the same chart. Then the same again with the host loaded (one busy process per core, at
the host's ordinary weight): a preloaded pool's first chart beside a raw kernel's start plus
chart under the same load, so that the sandboxes' CPU weight (sandbox/cgroups.py
`rescale_parent`) shows.

`python -m bench.first_chart [--quick]` runs this part alone, prints its table and writes
bench/results/first_chart.{md,json}; `make bench` includes it in bench/results/latest.*.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench import raw
from bench.interleave import Measure, Sampled, Untimed, interleaved, quiet
from bench.machines import CHART, CSV_NAME, PNG, sales_csv
from bench.part_results import save_part
from bench.served import API_KEY, served
from bench.stats import beside, summarize_sampled
from sandbox.backends.registry import why_unavailable
from sandbox.preload import ANALYST_PRELOAD

BASELINE = "raw: kernel start"
RAW_CHART = "raw: kernel start + first chart"
RAW_CHART_LOADED = "raw: kernel start + first chart, host loaded"
LOADED = ", host loaded"
GOAL_MS = 150.0
PRELOAD_MODULES = "pandas,numpy,matplotlib.pyplot"


def name_of(backend: str, preloaded: bool, loaded: bool = False) -> str:
    how = "preloaded pool" if preloaded else "pool, no preload"
    return f"{backend}: fresh session to first chart, {how}" + (LOADED if loaded else "")


@contextlib.contextmanager
def busy_host() -> Iterator[None]:
    """One busy process per core beside the measure, at the host's ordinary weight."""
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class Plan:
    charts: int  # samples of each measure, the raw floor's too


def samples(quick: bool) -> Plan:
    return Plan(3) if quick else Plan(12)


async def pool_full(api: httpx.AsyncClient, backend: str, limit_s: float = 180.0) -> None:
    deadline = time.monotonic() + limit_s
    while (await api.get("/v1/status")).json()["pools"].get(backend, 0) < 1:
        assert time.monotonic() < deadline, f"the {backend} pool did not fill"
        await asyncio.sleep(0.05)


async def first_chart(api: httpx.AsyncClient, backend: str, data: bytes, after: Untimed) -> None:
    """From the create to the PNG in hand; the session came from the pool. Its deletion is
    left to `after`, outside the clock."""
    created = (await api.post("/v1/sessions", json={"backend": backend})).json()
    sid = created["id"]
    after.later(partial(api.delete, f"/v1/sessions/{sid}"))
    up = await api.post(f"/v1/sessions/{sid}/files", files={"file": (CSV_NAME, data)})
    assert up.status_code in (200, 201), up.text
    ran = (
        await api.post(f"/v1/sessions/{sid}/execute", json={"code": CHART.format(path=CSV_NAME)})
    ).json()
    pngs = [base64.b64decode(r["png"]) for r in ran.get("results", []) if r.get("png") is not None]
    assert ran["error"] is None, ran["error"]
    assert pngs and pngs[0][:4] == PNG, "no PNG came back"
    assert created["from_pool"] is True, "the session did not come from the pool"


@contextlib.asynccontextmanager
async def _service(backend: str, preloaded: bool) -> AsyncIterator[httpx.AsyncClient]:
    settings = {
        "backends": backend,
        "default_backend": backend,
        "pool_size": "1",
    }
    if preloaded:
        settings |= {"preload_modules": PRELOAD_MODULES, "preload_code": ANALYST_PRELOAD}
    async with (
        served(**settings) as url,
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300
        ) as api,
    ):
        yield api


async def _raw_chart(data: bytes, scratch: Path, after: Untimed) -> None:
    km, kc = await raw.start()
    after.later(partial(raw.stop, km, kc))
    csv = scratch / CSV_NAME
    await asyncio.to_thread(csv.write_bytes, data)
    got = await raw.run(kc, CHART.format(path=str(csv)))
    assert got["png"] and got["png"][0][:4] == PNG, "no PNG came back"


async def _round(plan: Plan, data: bytes, *, loaded: bool) -> dict[str, Sampled]:
    """Every service up at once (each a warm pool of one, local and Docker, with and without a
    preload; loaded: preloaded only), their first charts and the raw floor's taken in turns;
    before each sample, every pool is full again (untimed), so no refill runs beside it."""
    async with contextlib.AsyncExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(prefix="cir-bench-chart-", dir="/tmp"))
        stack.callback(shutil.rmtree, scratch, True)
        services: dict[str, tuple[httpx.AsyncClient, str]] = {}
        for backend in backends_here():
            for preloaded in (True,) if loaded else (False, True):
                api = await stack.enter_async_context(_service(backend, preloaded))
                services[name_of(backend, preloaded, loaded)] = (api, backend)

        after = Untimed()
        stack.push_async_callback(after.run)

        async def every_pool_full() -> None:
            await after.run()
            for api, backend in services.values():
                await pool_full(api, backend)
            if not loaded:  # loaded, the host is never quiet
                await quiet()

        measures = {
            (RAW_CHART_LOADED if loaded else RAW_CHART): Measure(
                partial(_raw_chart, data, scratch, after), every_pool_full
            ),
            **{
                name: Measure(partial(first_chart, api, backend, data, after), every_pool_full)
                for name, (api, backend) in services.items()
            },
        }
        if not loaded:
            measures = {
                BASELINE: Measure(partial(raw.start_untimed_stop, after), every_pool_full),
                **measures,
            }
        if loaded:
            stack.enter_context(busy_host())
        return await interleaved(measures, plan.charts, batch=1, warmup=1, settle=not loaded)


def backends_here() -> list[str]:
    return [b for b in ("local", "docker") if why_unavailable(b) is None]


async def measure(plan: Plan) -> dict[str, Any]:
    data = sales_csv()
    out = await _round(plan, data, loaded=False) | await _round(plan, data, loaded=True)
    return {"plan": asdict(plan), "rows": rows_of(out), "csv_bytes": len(data)}


def rows_of(out: dict[str, Sampled]) -> list[dict[str, Any]]:
    """Each measure's summary and its median over the raw start's; the preloaded pools' goal."""
    rows = []
    for name, sampled in out.items():
        row: dict[str, Any] = {"name": name, "samples": sampled.wall}
        row |= beside(sampled, out[BASELINE])
        stats = row["stats"]
        if name.endswith(LOADED) and name != RAW_CHART_LOADED and RAW_CHART_LOADED in out:
            # beside raw under the same load
            loaded_raw = summarize_sampled(out[RAW_CHART_LOADED])["median_ms"]
            row["loaded_ratio"] = stats["median_ms"] / loaded_raw
        if name.endswith("preloaded pool"):
            row["goal"] = f"<= {GOAL_MS:g} ms"
            row["met"] = stats["median_ms"] <= GOAL_MS
        rows.append(row)
    return rows


def section(figures: dict[str, Any]) -> list[str]:
    """The report's section on a fresh session's first chart, as markdown lines."""
    out = [
        "## A fresh session to its first chart (local and Docker, over HTTP)",
        "",
        "The service with a warm pool of one, each session handed over from it inside the clock: "
        f"a {figures['csv_bytes'] / 2**20:.2f} MiB CSV uploaded, read by pandas, plotted by "
        "matplotlib, the PNG in hand. `pool, no preload` is the pool as it was; `preloaded pool` "
        f"sets `preload_modules={PRELOAD_MODULES}` and the analyst warm-up "
        "(sandbox/preload.py). Ratio: median over a raw jupyter_client kernel start of the same "
        "run. Every measure's samples were taken in turns with the floor's (bench/interleave.py), "
        "every pool full before each. CPU: the whole host's CPU time over a sample, median. Rows "
        "ending `host loaded` ran beside one busy process per core; their `vs raw loaded` is the "
        "median over the raw kernel's start plus chart under the same load (raw kernels weighed "
        "as one live sandbox each: bench/raw_group.py).",
        "",
        "| measure | median ms | p95 ms | min ms | max ms | n | ratio | CPU ms | CPU ratio "
        "| vs raw loaded | goal | met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in figures["rows"]:
        s = row["stats"]
        met = "" if "met" not in row else "yes" if row["met"] else "**no**"
        loaded = f"{row['loaded_ratio']:.2f}x" if "loaded_ratio" in row else ""
        # Under load, the host's CPU is mostly the busy processes': no figure of the sample's.
        cpu, cpu_ratio = (
            ("", "")
            if row["name"].endswith(LOADED)
            else (f"{s['cpu_median_ms']:.0f}", f"{row['cpu_ratio']:.2f}x")
        )
        out.append(
            f"| {row['name']} | {s['median_ms']:.0f} | {s['p95_ms']:.0f} | {s['min_ms']:.0f} "
            f"| {s['max_ms']:.0f} | {s['n']} | {row['ratio']:.2f}x | {cpu} "
            f"| {cpu_ratio} | {loaded} "
            f"| {row.get('goal', '')} | {met} |"
        )
    return [*out, ""]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few samples of each measure")
    args = parser.parse_args()
    figures = asyncio.run(measure(samples(args.quick)))
    save_part("first_chart", figures, section(figures))
