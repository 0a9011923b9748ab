"""What pausing, resuming, snapshotting and forking a session cost, beside what they save: a cold
start plus re-running the cells that built the session's state, measured in the same run.

The state: a CSV of 1.25 million sales written to the workspace, read into a pandas DataFrame,
grouped by store and merged back, and a ridge regression fitted on it and used to predict: about
105 MiB of DataFrame, the fitted model, and the CSV file. Each sample builds it in a new session
through a real `code-interpreter serve` (warm pool off, so every sandbox, created or resumed,
starts cold), then times over HTTP:
- the baseline: the session's creation (POST /v1/sessions) plus the build cells, as a client
  without pause and resume would start again;
- snapshot (POST .../snapshots) and fork (POST /v1/sessions {"snapshot_id"}, until the new
  session answers, its state restored);
- pause (POST .../pause), then resume (POST .../resume);
- pause again, then the first execute on the paused session (a lazy resume: the call wakes it).
After each restore the state is checked against the fingerprint the build printed: a figure of a
resume that lost the state would be none.

`python -m bench.persistence [--quick]` runs this part alone, prints its table and writes
bench/results/persistence.{md,json}; `make bench` includes it in bench/results/latest.*.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.interleave import Sampled, host_cpu_seconds
from bench.part_results import save_part
from bench.served import API_KEY, served
from bench.stats import beside
from sandbox.backends.registry import why_unavailable

# The cells that build the state, each a step an analysis would take.
BUILD_CELLS = (
    # The data arrives in the workspace (as an upload or a download would put it there).
    "import os, numpy as np, pandas as pd\n"
    "rng = np.random.default_rng(0)\n"
    "n = 1_250_000\n"
    "pd.DataFrame({'store': rng.integers(0, 500, n), 'day': rng.integers(0, 365, n),\n"
    "              'units': rng.poisson(20, n), 'price': rng.gamma(2.0, 5.0, n).round(2)}\n"
    "             ).to_csv('sales.csv', index=False)",
    # Read it, and derive columns.
    "sales = pd.read_csv('sales.csv')\n"
    "sales['revenue'] = sales['units'] * sales['price']\n"
    "sales['log_price'] = np.log1p(sales['price'])\n"
    "sales['weekday'] = sales['day'] % 7",
    # A groupby, merged back.
    "by_store = sales.groupby('store').agg(store_revenue=('revenue', 'mean'),\n"
    "                                      store_units=('units', 'std'))\n"
    "sales = sales.merge(by_store, left_on='store', right_index=True)\n"
    "sales['revenue_vs_store'] = sales['revenue'] / sales['store_revenue']",
    # A model fit, and its predictions.
    "from sklearn.linear_model import Ridge\n"
    "features = ['log_price', 'weekday', 'store_revenue', 'store_units']\n"
    "model = Ridge(alpha=1.0).fit(sales[features], sales['units'])\n"
    "sales['predicted_units'] = model.predict(sales[features])",
)
# What the state is: printed after the build and after every restore; they must be equal.
FINGERPRINT = (
    "print(len(sales), sales.shape[1], round(float(sales['predicted_units'].sum()), 3),\n"
    "      round(float(model.coef_[0]), 9), os.path.getsize('sales.csv'),\n"
    "      round(sales.memory_usage(deep=True).sum() / 2**20, 1))"
)
MEASURES = (
    "cold start + re-run (baseline)",
    "cold start",
    "re-run of the build cells",
    "snapshot",
    "fork from the snapshot",
    "pause",
    "resume (POST .../resume)",
    "first execute after a pause (lazy resume)",
)
BASELINE = MEASURES[0]


def samples(quick: bool) -> int:
    """Samples per backend: each builds ~105 MiB of state and saves it twice, seconds apiece."""
    return 1 if quick else 3


class Client:
    """The service's REST API, every answer checked: a failed call is a failed benchmark."""

    def __init__(self, api: httpx.AsyncClient) -> None:
        self.api = api

    async def call(self, path: str, body: dict[str, Any] | None, expect: int) -> Any:
        answer = await self.api.post(path, json=body)
        assert answer.status_code == expect, (path, answer.status_code, answer.text)
        return answer.json()

    async def run(self, sid: str, code: str) -> str:
        body = {"code": code, "timeout_s": 600}
        done = await self.call(f"/v1/sessions/{sid}/execute", body, 200)
        assert done["status"] == "ok", done
        return str(done["stdout"])

    async def delete(self, path: str) -> None:
        answer = await self.api.delete(path)
        assert answer.status_code == 204, (path, answer.status_code, answer.text)


def _bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def one_sample(
    client: Client, backend: str, snapshots_dir: Path, out: dict[str, Sampled]
) -> dict[str, int]:
    """One session built, snapshotted, forked, paused and resumed; appends a sample of each
    measure (wall time, and the host's CPU time over it) to `out` and returns the bytes each
    kind of save kept."""
    cpu: dict[str, float] = {}

    async def timed(coroutine: Any) -> tuple[float, Any]:
        used = host_cpu_seconds()
        t = time.perf_counter()
        got = await coroutine
        took = time.perf_counter() - t
        cpu[str(len(cpu))] = host_cpu_seconds() - used
        return took, got

    cold, created = await timed(client.call("/v1/sessions", {"backend": backend}, 201))
    sid = created["id"]
    rerun = 0.0
    for cell in BUILD_CELLS:
        took, _ = await timed(client.run(sid, cell))
        rerun += took
    fingerprint = await client.run(sid, FINGERPRINT)

    took_snapshot, snapshot = await timed(
        client.call(f"/v1/sessions/{sid}/snapshots", {"name": "bench"}, 201)
    )
    took_fork, fork = await timed(
        client.call("/v1/sessions", {"backend": backend, "snapshot_id": snapshot["id"]}, 201)
    )
    assert await client.run(fork["id"], FINGERPRINT) == fingerprint, "the fork lost state"
    await client.delete(f"/v1/sessions/{fork['id']}")
    await client.delete(f"/v1/snapshots/{snapshot['id']}")

    took_pause, _ = await timed(client.call(f"/v1/sessions/{sid}/pause", None, 200))
    paused_bytes = _bytes_under(snapshots_dir)
    took_resume, resumed = await timed(client.call(f"/v1/sessions/{sid}/resume", None, 200))
    assert resumed["session"]["state"] == "running", resumed
    assert await client.run(sid, FINGERPRINT) == fingerprint, "the resume lost state"

    await client.call(f"/v1/sessions/{sid}/pause", None, 200)
    took_lazy, shown = await timed(client.run(sid, FINGERPRINT))
    assert shown == fingerprint, "the lazy resume lost state"
    await client.delete(f"/v1/sessions/{sid}")

    # The order `timed` ran in: cold, the build cells, snapshot, fork, pause, resume, lazy.
    spent = list(cpu.values())
    cold_cpu, rerun_cpu = spent[0], sum(spent[1 : 1 + len(BUILD_CELLS)])
    later = spent[1 + len(BUILD_CELLS) :]
    for name, value, used in zip(
        MEASURES,
        (cold + rerun, cold, rerun, took_snapshot, took_fork, took_pause, took_resume, took_lazy),
        (cold_cpu + rerun_cpu, cold_cpu, rerun_cpu, *later),
        strict=True,
    ):
        out[name].wall.append(value)
        out[name].cpu.append(used)
    return {"snapshot_bytes": int(snapshot["bytes"]), "paused_bytes_on_disk": paused_bytes}


async def measure(n: int) -> dict[str, Any]:
    """Every backend's figures, each measure beside the baseline of the same backend."""
    backends = [b for b in ("local", "docker") if why_unavailable(b) is None]
    not_run = {f"{b} backend": why for b in ("local", "docker") if (why := why_unavailable(b))}
    rows: list[dict[str, Any]] = []
    saved: dict[str, dict[str, int]] = {}
    root = Path(tempfile.mkdtemp(prefix="cir-bench-persistence-", dir="/tmp"))
    root.chmod(0o711)
    settings = {
        "state_dir": str(root / "state"),  # ours, to weigh what a pause keeps on disk
        "pool_size": "0",  # every sandbox starts cold: created, forked or resumed alike
        "backends": ",".join(backends),
        "default_backend": backends[0] if backends else "local",
    }
    try:
        async with (
            served(**settings) as url,
            httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=900
            ) as api,
        ):
            client = Client(api)
            out = {b: {m: Sampled() for m in MEASURES} for b in backends}
            for turn in range(n):  # the backends in turns, the order rotated each round
                shift = turn % max(1, len(backends))
                for backend in backends[shift:] + backends[:shift]:
                    saved[backend] = await one_sample(
                        client, backend, root / "state" / "snapshots", out[backend]
                    )
            for backend in backends:
                rows += rows_of(backend, out[backend])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"samples_per_backend": n, "rows": rows, "saved": saved, "not_run": not_run}


def rows_of(backend: str, out: dict[str, Sampled]) -> list[dict[str, Any]]:
    """One backend's rows: each measure's summary and its median over the baseline's."""
    return [
        {
            "backend": backend,
            "name": name,
            "samples": out[name].wall,
            **beside(out[name], out[BASELINE]),
        }
        for name in MEASURES
    ]


def section(figures: dict[str, Any]) -> list[str]:
    """The report's section on pause and resume, as markdown lines."""
    out = [
        "## Pause, resume, snapshots (a session holding ~105 MiB of pandas state)",
        "",
        "The state: a 1.25-million-row CSV written to the workspace, read into a DataFrame, a "
        "groupby merged back, a ridge regression fitted (bench/persistence.py). Baseline: a "
        "cold session start plus re-running those cells, same backend, same run. Ratio = "
        "measure / baseline, medians of "
        f"{figures['samples_per_backend']} samples per backend; warm pool off, so resumed and "
        "forked sessions start cold too; the backends' samples are taken in turns. CPU: the "
        "host's CPU time over the measure. Fork: until the new session answers, state restored. "
        "Lazy resume: the first execute on a paused session (it wakes it), until its result.",
        "",
        "| backend | measure | median ms | min ms | max ms | n | baseline median ms | ratio "
        "| CPU ms | CPU ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in figures["rows"]:
        s = row["stats"]
        out.append(
            f"| {row['backend']} | {row['name']} | {s['median_ms']:.0f} | {s['min_ms']:.0f} "
            f"| {s['max_ms']:.0f} | {s['n']} | {row['baseline_median_ms']:.0f} "
            f"| {row['ratio']:.2f}x | {s.get('cpu_median_ms', math.nan):.0f} "
            f"| {row.get('cpu_ratio', math.nan):.2f}x |"
        )
    out.append("")
    for backend, kept in figures["saved"].items():
        out.append(
            f"- **{backend}**: a snapshot keeps {kept['snapshot_bytes'] / 2**20:.1f} MiB; a "
            f"paused session {kept['paused_bytes_on_disk'] / 2**20:.1f} MiB on disk."
        )
    for what, why in figures["not_run"].items():
        out.append(f"- **{what}**: not run: {why}.")
    return [*out, ""]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one sample per backend")
    args = parser.parse_args()
    figures = asyncio.run(measure(samples(args.quick)))
    save_part("persistence", figures, section(figures))
