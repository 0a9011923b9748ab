"""The benchmark's outputs: a markdown report, the JSON behind it, and a chart of latencies."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from bench.agreement import section as agreement_section
from bench.cluster import section as cluster_section
from bench.first_chart import section as first_chart_section
from bench.machines import section as machines_section
from bench.microvm import section as microvm_section
from bench.persistence import section as persistence_section
from code_interpreter_wire.languages import LANGUAGES

RESULTS = Path(__file__).parent / "results"


def write(report: dict[str, Any]) -> str:
    """Write the run's report; the last run of the same kind becomes the previous one, which
    the report is compared with (bench/agreement.py). A quick run (a smoke test) keeps files of
    its own, quick.*, never latest.*."""
    RESULTS.mkdir(exist_ok=True)
    stem, previous = _files(report["kind"])
    latest = RESULTS / f"{stem}.json"
    if (last := _of_kind(latest, report["kind"])) is not None:
        previous.write_text(json.dumps(last, indent=2) + "\n")
    latest.write_text(json.dumps(report, indent=2) + "\n")
    return _shown(report, stem, _of_kind(previous, report["kind"]))


def _files(kind: str) -> tuple[str, Path]:
    """The stem of a run's files, and where the previous run of its kind is kept."""
    if kind == "quick":
        return "quick", RESULTS / "quick-previous.json"
    return "latest", RESULTS / "previous.json"


def _of_kind(path: Path, kind: str) -> dict[str, Any] | None:
    """The report kept at `path` if it is there, readable, and of `kind`."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("kind") == kind else None


def _shown(report: dict[str, Any], stem: str, before: dict[str, Any] | None) -> str:
    markdown = render(report, before)
    (RESULTS / f"{stem}.md").write_text(markdown)
    chart(report, RESULTS / f"{stem}.png")
    return markdown


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "n/a"


def _cells(table: dict[str, dict[str, float]], who: str, keys: list[int], fmt: str) -> list[str]:
    """One row's figures, each with its ratio to the raw floor's figure for the same key."""
    raw = table.get("raw", {})
    return [
        fmt.format(table[who][str(k)])
        + ("" if who == "raw" else f" ({_ratio(table[who][str(k)], raw.get(str(k), 0))})")
        for k in keys
    ]


def _cpu(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def _times(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def render(report: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    load = report["load"]
    out = [
        f"# Benchmark: {report['date']} on {report['machine']}",
        "",
        f"A `{report['kind']}` run (`make bench`; `make bench-full` adds the long parts): "
        f"{load['wall_s'] / 60:.1f} minutes, the host's CPU busy {load['cpu_s']:.0f} s of "
        f"{load['wall_s'] * load['cores']:.0f} s. Every figure beside its baseline, the two "
        "sampled in turns in the same minutes (bench/interleave.py): mostly a raw "
        "jupyter_client kernel driving ipykernel directly (TCP, no sandbox, no service); "
        f"{report['raw_weight']}. Ratio = ours / baseline, medians. CPU: the whole host's CPU "
        f"time over one sample (every process: client, service, sandbox, kernel; "
        f"{report['cpu_counter']}), median; CPU ratio likewise.",
        "",
        *load_section(report),
        *agreement_section(report, before),
        "## Latency",
        "",
        "| measure | median ms | p95 ms | stdev ms | n | baseline median ms | ratio | CPU ms "
        "| CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["latency"]:
        s = row["stats"]
        out.append(
            f"| {row['name']} | {s['median_ms']:.2f} | {s['p95_ms']:.2f} | {s['stdev_ms']:.2f} "
            f"| {s['n']} | {row['baseline_median_ms']:.2f} | {row['ratio']:.2f}x "
            f"| {_cpu(s['cpu_median_ms'])} | {_times(row['cpu_ratio'])} |"
        )
    out.append("")
    if "languages" in report:
        out += languages_section(report["languages"])
    if "persistence" in report:
        out += persistence_section(report["persistence"])
    if "first_chart" in report:
        out += first_chart_section(report["first_chart"])
    if "microvm" in report:
        out += microvm_section(report["microvm"])
    if "machines" in report:
        out += machines_section(report["machines"])
    if "cluster" in report:
        out += cluster_section(report["cluster"])
    if report["heavy"]:
        out += [
            "## Large outputs (time to have it all in hand, median of 3 fresh processes; largest "
            "peak memory of the caller's process)",
            "",
            "| case | who | seconds | peak MiB | time ratio | memory ratio |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in report["heavy"]:
            out.append(
                f"| {row['case']} | {row['who']} | {row['seconds']:.3f} | {row['peak_mb']:.0f} | "
                f"{row['time_ratio']} | {row['memory_ratio']} |"
            )
        out.append("")
    levels = report["throughput_levels"]
    if report["throughput"]:
        out += [
            "## Throughput (trivial executes per second, all sessions together)",
            "",
            "| who | " + " | ".join(f"sessions: {n}" for n in levels) + " |",
            "|---|" + "---:|" * len(levels),
        ]
        for who in report["throughput"]:
            cells = _cells(report["throughput"], who, levels, "{:.0f}")
            out.append(f"| {who} | " + " | ".join(cells) + " |")
        out.append("")
    out += density_section(report)
    out += [
        "## Peers",
        "",
    ]
    for name, peer in report["peers"].items():
        out.append(f"- **{name}**: {peer}")
    for name, why in report["not_run"].items():
        out.append(f"- **{name}**: not run: {why}.")
    out += ["", "![latency distributions](latest.png)", ""]
    return "\n".join(out)


def load_section(report: dict[str, Any]) -> list[str]:
    """How long each part took, and the machine's load as each began and ended."""
    out = [
        "## The run: its parts and the machine's load",
        "",
        "| mark | at s | load 1 min | load 5 min | CPU pressure 10 s % |",
        "|---|---:|---:|---:|---:|",
    ]
    for mark in report["load"]["marks"]:
        pressure = mark["cpu_pressure_10s"]
        out.append(
            f"| {mark['what']} | {mark['at_s']:.0f} | {mark['load_1m']:.2f} "
            f"| {mark['load_5m']:.2f} | {'' if pressure is None else f'{pressure:.1f}'} |"
        )
    return [*out, ""]


def density_section(report: dict[str, Any]) -> list[str]:
    """Memory per idle session; a preloaded session's beside a bare one of the same backend."""
    counts = report["density_counts"]
    out = [
        "## Density (memory per idle session, PSS: sandbox plus the caller's process)",
        "",
        "Ratios in brackets: to the raw kernel's figure at the same count. `preloaded`: each "
        "session ran the first-chart part's preload (the analyst stack imported and warmed), "
        "as a preloading pool's sessions have; `forked from a zygote`: their kernels forked "
        "from a zygote that imported the same modules once (the service does so with "
        "`preload_modules` on the local and docker backends), the zygote counted; `vs bare` is "
        "its figure over the same backend's bare session at the largest count (goal: at most "
        "1.5x).",
        "",
        "| who | " + " | ".join(f"sessions: {n}, MiB" for n in counts) + " | vs bare | most "
        "sessions the free memory holds |",
        "|---|" + "---:|" * (len(counts) + 2),
    ]
    last = str(counts[-1])
    for who, by_count in report["density"].items():
        cells = _cells(report["density"], who, counts, "{:.1f}")
        preloaded = ", preloaded" in who  # "local, preloaded" and "..., forked from a zygote"
        bare = report["density"].get(who.split(", ")[0], {}).get(last)
        vs_bare = f"{by_count[last] / bare:.2f}x" if preloaded and bare else ""
        out.append(
            f"| {who} | " + " | ".join(cells) + f" | {vs_bare} | {report['capacity'][who]} |"
        )
    return [
        *out,
        "",
        "The last column divides the memory free at the start by the per-session figure at the "
        "largest count; the default limits (2 GiB per session) are ceilings, not reservations, "
        "so memory actually used is what bounds density.",
        "",
    ]


def languages_section(figures: dict[str, Any]) -> list[str]:
    """The report's section on languages, as markdown lines."""
    out = [
        "## Languages (each kernel beside Python's; Docker: the full image)",
        "",
        "Cold start: the first call in the language in a running sandbox, until its result, "
        "starting the language's kernel included (Python: the sandbox's creation and its first "
        "call, as its kernel starts with the sandbox); a fresh sandbox per sample. Raw: the same "
        "kernel, same command line, started by jupyter_client over TCP, until its first result. "
        "Round trip: the language's trivial expression (`1+1`; bash: `echo $((1+1))`) on a "
        "started kernel. Ours and the raw kernel's samples are taken in turns. Ratio = ours / "
        "raw, medians; CPU ratio likewise, of the host's CPU time over a sample. Raw stops "
        "reading at the answer; ours cannot know the answer, so for Deno's kernels (JavaScript, "
        "TypeScript), which may publish output after their idle status, it sends a flush request "
        "after each call and reads until its reply (sandbox/kernel/late_output.py). Of few "
        "samples, p95 is the largest.",
        "",
        "| language | who | cold start median ms | p95 ms | n | raw median ms | ratio "
        "| CPU ratio | round trip median ms | p95 ms | n | raw median ms | ratio | CPU ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(LANGUAGES)}
    for row in sorted(figures["rows"], key=lambda r: order[r["language"]]):
        cells = []
        for key in ("cold", "round_trip"):
            part = row[key]
            s = part["stats"]
            cells.append(
                f"{s['median_ms']:.2f} | {s['p95_ms']:.2f} | {s['n']} | "
                f"{part['baseline_median_ms']:.2f} | {part['ratio']:.2f}x "
                f"| {_times(part['cpu_ratio'])}"
            )
        out.append(f"| {row['language']} | {row['who']} | " + " | ".join(cells) + " |")
    if figures["not_run"]:
        out.append("")
    for what, why in figures["not_run"].items():
        out.append(f"- **{what}**: not run: {why}.")
    return [*out, ""]


def _horizontal(version: str) -> dict[str, Any]:
    """Horizontal boxes, as this matplotlib says it (3.10 renamed `vert` to `orientation`)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    newer = found is None or (int(found[1]), int(found[2])) >= (3, 10)
    return {"orientation": "horizontal"} if newer else {"vert": False}


def chart(report: dict[str, Any], path: Path) -> None:
    """Latency distributions; below them, a fresh session's first chart before the preloaded
    pools (a pool without a preload) and after (a preloaded pool), beside the raw floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["latency"]
    charts = [r for r in report.get("first_chart", {}).get("rows", []) if r.get("samples")]
    heights = [0.45 * len(rows) + 1.5] + ([0.45 * len(charts) + 1.5] if charts else [])
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(10, sum(heights)), gridspec_kw={"height_ratios": heights}
    )
    axes = list(axes) if charts else [axes]
    panels = [(rows, report["samples"], f"Latency distributions, {report['date']}")]
    if charts:
        by_name = {r["name"]: r["samples"] for r in charts}
        title = "First chart: before (pool, no preload) and after (preloaded pool)"
        panels.append((charts, by_name, title))
    for ax, (panel_rows, samples, title) in zip(axes, panels, strict=True):
        names = [r["name"] for r in panel_rows]
        data = [[v * 1000 for v in samples[name]] for name in names]
        ax.boxplot(data, tick_labels=names, showfliers=True, **_horizontal(matplotlib.__version__))
        ax.set_xscale("log")
        ax.set_xlabel("milliseconds (log scale)")
        ax.set_title(title)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rerender(stem: str = "latest") -> str:
    """<stem>.md and .png again from <stem>.json (after a change to how they are shown),
    compared with the previous run as the run was; nothing is measured or moved."""
    report = json.loads((RESULTS / f"{stem}.json").read_text())
    _, previous = _files(report["kind"])
    return _shown(report, stem, _of_kind(previous, report["kind"]))


if __name__ == "__main__":
    print(rerender())
