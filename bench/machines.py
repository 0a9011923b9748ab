"""What the `gvisor` backend's machines promise (docs/gvisor.md, "Machine sandboxes"), each figure
beside a raw jupyter_client kernel start measured in the same run (bench/raw.py's floor):

1. pause and resume of a machine holding a ~100 MiB DataFrame and a background process: the
   time of `suspend()` and of `wake()` until the sandbox answers `1+1`, and the checkpoint's
   size on disk beside the DataFrame's own `memory_usage(deep=True)`. After every wake the
   frame's fingerprint and the process (still running, still counting) are checked: a figure
   of a resume that lost either would be none.
2. a cold session start restored from a template (pandas and matplotlib imported, a first
   figure drawn): `create()` until the sandbox answers `1+1`, and `pandas` in `sys.modules`.
3. a fresh session to its first chart: create, a 0.5 MB CSV uploaded, pandas reads it and
   matplotlib plots it, the PNG in hand; unpooled (create inside the clock) and pooled (the
   sandbox made before the clock starts, as the service's warm pool holds one).

All three on the backend as the service runs it: templates on, the default spec's template
made before any clock starts, so every sandbox here is restored from it. Beside them, for
scale, machines booted without a template, and a raw kernel's start plus the same first chart.
Each measure is stated beside its goal and whether this run met it.

`python -m bench.machines [--quick]` runs this part alone, prints its table and writes
bench/results/machines.{md,json}; `make bench-full` includes it in bench/results/latest.*.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import raw
from bench.part_results import save_part
from bench.stats import summarize
from code_interpreter_wire.processes import ProcessRequest
from code_interpreter_wire.spec import SandboxSpec
from sandbox import Sandbox
from sandbox.backends.gvisor.backend import GvisorBackend, GvisorBackendConfig
from sandbox.backends.registry import why_unavailable

BASELINE = "raw: kernel start"
# The state a paused machine holds: 5 columns of 2.6 million random 8-byte values, 100 MiB,
# random so that no compression of the image makes it look smaller than it is.
BUILD_FRAME = (
    "import numpy as np, pandas as pd\n"
    "rng = np.random.default_rng(0)\n"
    "n = 2_621_440\n"
    "frame = pd.DataFrame({'a': rng.random(n), 'b': rng.random(n), 'c': rng.random(n),\n"
    "                      'd': rng.integers(0, 1 << 62, n), 'e': rng.standard_normal(n)})\n"
    "int(frame.memory_usage(deep=True).sum())"
)
FINGERPRINT = (
    "(len(frame), int(frame.memory_usage(deep=True).sum()), "
    "int(pd.util.hash_pandas_object(frame).sum()))"
)
# The background process: counts into a file of the machine's own /tmp (saved with it).
COUNTER_FILE = "/tmp/bench-count"
COUNTER = f"i=0; while true; do i=$((i+1)); echo $i > {COUNTER_FILE}; sleep 0.05; done"
READ_COUNTER = f"cat {COUNTER_FILE} 2>/dev/null || echo 0"
# The first chart: the uploaded CSV read and plotted.
CHART = (
    "import pandas as pd, matplotlib.pyplot as plt\n"
    "sales = pd.read_csv({path!r})\n"
    "sales.groupby('day')['units'].sum().plot(title='units by day')\n"
    "plt.show()"
)
CSV_NAME = "sales.csv"
PNG = b"\x89PNG"

SUSPEND = "gvisor: suspend (pause), ~100 MiB DataFrame + a process"
WAKE = "gvisor: wake (resume) until it answers 1+1"
COLD = "gvisor: cold session start, no template"
TEMPLATE = "gvisor: cold session start, restored from a template"
RAW_CHART = "raw: kernel start + first chart"
CHART_UNPOOLED = "gvisor: fresh session to first chart, unpooled"
CHART_POOLED = "gvisor: fresh session to first chart, pooled"
# Each goal: the measure it holds for, the most its median may be, and in what.
GOALS: dict[str, tuple[float, str]] = {
    SUSPEND: (1500.0, "ms"),
    WAKE: (1500.0, "ms"),
    TEMPLATE: (0.6, "x"),
    CHART_UNPOOLED: (1.0, "x"),
    CHART_POOLED: (150.0, "ms"),
}


@dataclass(frozen=True)
class Plan:
    """Samples of each measure; each machine start is ~1.5 s on a 2-core machine."""

    raw_starts: int
    pauses: int
    starts: int
    charts: int
    pooled: int


def samples(quick: bool) -> Plan:
    return Plan(3, 2, 3, 3, 5) if quick else Plan(10, 5, 10, 10, 15)


def sales_csv(size: int = 512 * 1024) -> bytes:
    """A CSV of sales, `size` bytes or a little more, the same every run."""
    rng = random.Random(0)
    rows = ["day,store,units,price"]
    length = len(rows[0]) + 1
    while length < size:
        day, store, units = rng.randrange(365), rng.randrange(500), rng.randrange(60)
        row = f"{day},{store},{units},{rng.uniform(1, 99):.2f}"
        rows.append(row)
        length += len(row) + 1
    return ("\n".join(rows) + "\n").encode()


async def expect(sb: Sandbox, code: str, text: str | None = None) -> str:
    """Run `code`; it must succeed (with `text` as its value, if given): its value."""
    ex = await sb.execute(code, timeout_s=300)
    assert ex.error is None and ex.status == "ok", (code, ex.status, ex.error, ex.stderr)
    assert text is None or ex.text == text, (code, ex.text, text)
    return ex.text or ""


async def counted(sb: Sandbox) -> int:
    result = await sb.run_command(ProcessRequest(command=READ_COUNTER))
    assert result.exit_code == 0, result
    return int(result.stdout.strip() or 0)


async def counts_past(sb: Sandbox, floor: int, limit_s: float = 30.0) -> int:
    """The counter's value once it is past `floor`: the process runs. Fails after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while (now := await counted(sb)) <= floor:
        assert time.monotonic() < deadline, f"the process never counted past {floor}"
        await asyncio.sleep(0.05)
    return now


def bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


async def pause_and_resume(
    backend: GvisorBackend, spec: SandboxSpec, out: dict[str, list[float]]
) -> dict[str, int]:
    """One machine built, paused and woken; appends a sample of each to `out` and returns the
    sizes: the DataFrame's, and the paused machine's on disk (all of it, and its image)."""
    sb = await backend.create(spec)
    try:
        frame_bytes = int(await expect(sb, BUILD_FRAME))
        fingerprint = await expect(sb, FINGERPRINT)
        process = await sb.start_process(ProcessRequest(command=COUNTER))
        before = await counts_past(sb, 2)
        t = time.perf_counter()
        handle = await sb.suspend()
        out[SUSPEND].append(time.perf_counter() - t)
    except BaseException:
        await sb.close()
        raise
    assert handle is not None, "the machine could not be saved whole"
    paused = backend.paused_dir / handle
    sizes = {
        "frame_bytes": frame_bytes,
        "paused_bytes": bytes_under(paused),
        "image_bytes": bytes_under(paused / "image"),
    }
    t = time.perf_counter()
    woken = await backend.wake(handle, spec)
    try:
        await expect(woken, "1+1", "2")
        out[WAKE].append(time.perf_counter() - t)
        assert await expect(woken, FINGERPRINT) == fingerprint, "the resume lost the DataFrame"
        assert woken.process(process.pid).running, "the process did not survive the resume"
        await counts_past(woken, before)
    finally:
        await woken.close()
    return sizes


async def start_once(backend: GvisorBackend, spec: SandboxSpec) -> tuple[float, Sandbox]:
    """Seconds to create a sandbox until it answers `1+1`, and the sandbox."""
    t = time.perf_counter()
    sb = await backend.create(spec)
    try:
        await expect(sb, "1+1", "2")
    except BaseException:
        await sb.close()
        raise
    return time.perf_counter() - t, sb


async def starts(backend: GvisorBackend, spec: SandboxSpec, n: int) -> tuple[list[float], bool]:
    """`n` cold starts, and whether every sandbox had pandas imported when it answered."""
    took, preloaded = [], True
    for _ in range(n):
        seconds, sb = await start_once(backend, spec)
        try:
            took.append(seconds)
            has = await expect(sb, "import sys; 'pandas' in sys.modules")
            preloaded = preloaded and has == "True"
        finally:
            await sb.close()
    return took, preloaded


async def chart_in(sb: Sandbox, data: bytes) -> None:
    await sb.upload(CSV_NAME, data)
    ex = await sb.execute(CHART.format(path=CSV_NAME), timeout_s=300)
    assert ex.status == "ok" and ex.error is None, (ex.status, ex.error, ex.stderr)
    assert any(a.data[:4] == PNG for a in ex.artifacts), "no PNG came back"


async def first_charts(
    backend: GvisorBackend, spec: SandboxSpec, plan: Plan, data: bytes
) -> tuple[list[float], list[float]]:
    """Fresh sessions to their first chart: unpooled (created inside the clock), then pooled
    (created before it)."""
    unpooled = []
    for _ in range(plan.charts):
        t = time.perf_counter()
        sb = await backend.create(spec)
        try:
            await chart_in(sb, data)
            unpooled.append(time.perf_counter() - t)
        finally:
            await sb.close()
    pooled = []
    for _ in range(plan.pooled):
        sb = await backend.create(spec)
        try:  # as the pool hands one over: created, its kernel answering, nothing run yet
            t = time.perf_counter()
            await chart_in(sb, data)
            pooled.append(time.perf_counter() - t)
        finally:
            await sb.close()
    return unpooled, pooled


async def raw_floor(n: int, data: bytes, scratch: Path) -> tuple[list[float], list[float]]:
    """The baseline: raw kernel starts; and a raw kernel's start plus the same first chart."""
    km, kc = await raw.start()  # warms the imports a start pays for once per process
    await raw.stop(km, kc)
    start_samples: list[float] = []
    chart_samples: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        km, kc = await raw.start()
        start_samples.append(time.perf_counter() - t)
        await raw.stop(km, kc)
    csv = scratch / CSV_NAME
    for _ in range(n):
        t = time.perf_counter()
        km, kc = await raw.start()
        try:
            await asyncio.to_thread(csv.write_bytes, data)
            got = await raw.run(kc, CHART.format(path=str(csv)))
            assert got["png"] and got["png"][0][:4] == PNG, "no PNG came back"
            chart_samples.append(time.perf_counter() - t)
        finally:
            await raw.stop(km, kc)
    return start_samples, chart_samples


async def measure(plan: Plan) -> dict[str, Any]:
    """Every measure of the machines beside the raw kernel start of the same run."""
    root = Path(tempfile.mkdtemp(prefix="cir-bench-machines-", dir="/tmp"))
    root.chmod(0o711)
    data = sales_csv()
    spec = SandboxSpec()  # the default spec: the one the template is made for
    state = root / "state"
    # The order of the report's rows: the baselines first.
    out: dict[str, list[float]] = {BASELINE: [], RAW_CHART: []}
    template: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    try:
        out[BASELINE], out[RAW_CHART] = await raw_floor(plan.raw_starts, data, root)
        # Machines booted, none restored: templates off (on, the first start makes one).
        cold = GvisorBackend(GvisorBackendConfig(state_dir=state, templates=False))
        try:
            _, sb = await start_once(cold, spec)  # the image's root filesystem, unpacked once
            await sb.close()
            out[COLD], _ = await starts(cold, spec, plan.starts)
        finally:
            await cold.close()
        # As the service runs it: templates on, the default spec's made before the clocks.
        backend = GvisorBackend(GvisorBackendConfig(state_dir=state))
        try:
            t = time.perf_counter()
            made = await backend.prepare_templates(spec)
            template["prepare_s"] = time.perf_counter() - t
            template["bytes"] = bytes_under(made)
            out[TEMPLATE], template["pandas_imported"] = await starts(backend, spec, plan.starts)
            out[SUSPEND], out[WAKE] = [], []
            for _ in range(plan.pauses):
                sizes = await pause_and_resume(backend, spec, out)
            out[CHART_UNPOOLED], out[CHART_POOLED] = await first_charts(backend, spec, plan, data)
            # An unusable template is dropped and its sandboxes boot cold: none of them was.
            assert (made / "manifest.json").is_file(), "the template was dropped along the way"
        finally:
            await backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "plan": asdict(plan),
        "rows": rows_of(out, template),
        "sizes": sizes,
        "template": template,
        "csv_bytes": len(data),
    }


def rows_of(out: dict[str, list[float]], template: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measure's summary, its median over the raw kernel start's, its goal and verdict."""
    base = summarize(out[BASELINE])["median_ms"]
    rows = []
    for name, values in out.items():
        stats = summarize(values)
        ratio = stats["median_ms"] / base
        row: dict[str, Any] = {
            "name": name,
            "stats": stats,
            "samples": values,
            "baseline": BASELINE,
            "baseline_median_ms": base,
            "ratio": ratio,
        }
        if name in GOALS:
            most, unit = GOALS[name]
            row["goal"] = f"<= {most:g} {unit}" if unit == "ms" else f"<= {most:g}x"
            row["met"] = (stats["median_ms"] if unit == "ms" else ratio) <= most
            if name == TEMPLATE:  # a start without pandas at hand is not what was asked for
                row["met"] = row["met"] and bool(template.get("pandas_imported"))
        rows.append(row)
    return rows


def section(figures: dict[str, Any]) -> list[str]:
    """The report's section on the gvisor backend's machines, as markdown lines."""
    plan = figures["plan"]
    out = [
        "## Machine sandboxes (`gvisor`): pause and resume, template starts, first chart",
        "",
        "Each measure beside a raw jupyter_client kernel start of the same run (ratio = median / "
        f"its median; {plan['raw_starts']} raw starts). Every gvisor sandbox but the "
        "no-template row's is restored from the default spec's template (pandas, numpy, "
        "matplotlib imported, a figure drawn). Pause: `suspend()` of a machine holding "
        "a ~100 MiB DataFrame and a shell loop counting into a file; resume: `wake()` until it "
        "answers `1+1`, the frame's hash and the loop's counting checked after each. Starts: "
        "`create()` until `1+1`. First chart: a "
        f"{figures['csv_bytes'] / 2**20:.2f} MiB CSV uploaded, read by pandas, plotted, the PNG "
        "in hand; unpooled with the create inside the clock, pooled with it made before. "
        "Goals are the project's issue's; met means the median is within it.",
        "",
        "| measure | median ms | p95 ms | min ms | max ms | n | ratio | goal | met |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in figures["rows"]:
        s = row["stats"]
        met = "" if "met" not in row else "yes" if row["met"] else "**no**"
        out.append(
            f"| {row['name']} | {s['median_ms']:.0f} | {s['p95_ms']:.0f} | {s['min_ms']:.0f} "
            f"| {s['max_ms']:.0f} | {s['n']} | {row['ratio']:.2f}x | {row.get('goal', '')} "
            f"| {met} |"
        )
    out.append("")
    if sizes := figures["sizes"]:
        out.append(
            f"- The paused machine on disk: {sizes['paused_bytes'] / 2**20:.1f} MiB (its "
            f"checkpoint image {sizes['image_bytes'] / 2**20:.1f} MiB), holding a DataFrame of "
            f"{sizes['frame_bytes'] / 2**20:.1f} MiB (`memory_usage(deep=True).sum()`)."
        )
    template = figures["template"]
    out.append(
        f"- The template took {template['prepare_s']:.1f} s to make and keeps "
        f"{template['bytes'] / 2**20:.1f} MiB on disk; pandas was "
        + ("imported in every" if template["pandas_imported"] else "**not** imported in a")
        + " sandbox restored from it."
    )
    return [*out, ""]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few samples of each measure")
    args = parser.parse_args()
    if (why := why_unavailable("gvisor")) is not None:
        raise SystemExit(f"the gvisor backend is not available here: {why}")
    figures = asyncio.run(measure(samples(args.quick)))
    save_part("machines", figures, section(figures))
