"""The benchmark's outputs: a markdown report, the JSON behind it, and a chart of latencies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.cluster import section as cluster_section
from bench.first_chart import section as first_chart_section
from bench.machines import section as machines_section
from bench.persistence import section as persistence_section
from code_interpreter_wire.languages import LANGUAGES

RESULTS = Path(__file__).parent / "results"


def write(report: dict[str, Any]) -> str:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    markdown = render(report)
    (RESULTS / "latest.md").write_text(markdown)
    chart(report, RESULTS / "latest.png")
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


def render(report: dict[str, Any]) -> str:
    out = [
        f"# Benchmark: {report['date']} on {report['machine']}",
        "",
        "Every figure beside the raw floor measured in the same run: jupyter_client driving a "
        "local ipykernel directly (TCP, no sandbox, no service). Ratio = ours / raw, medians.",
        "",
        "## Latency",
        "",
        "| measure | median ms | p95 ms | stdev ms | n | raw median ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["latency"]:
        s = row["stats"]
        out.append(
            f"| {row['name']} | {s['median_ms']:.2f} | {s['p95_ms']:.2f} | {s['stdev_ms']:.2f} "
            f"| {s['n']} | {row['baseline_median_ms']:.2f} | {row['ratio']:.2f}x |"
        )
    out.append("")
    if "languages" in report:
        out += languages_section(report["languages"])
    if "persistence" in report:
        out += persistence_section(report["persistence"])
    if "first_chart" in report:
        out += first_chart_section(report["first_chart"])
    if "machines" in report:
        out += machines_section(report["machines"])
    if "cluster" in report:
        out += cluster_section(report["cluster"])
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
    levels = report["throughput_levels"]
    out += [
        "",
        "## Throughput (trivial executes per second, all sessions together)",
        "",
        "| who | " + " | ".join(f"sessions: {n}" for n in levels) + " |",
        "|---|" + "---:|" * len(levels),
    ]
    for who in report["throughput"]:
        out.append(
            f"| {who} | " + " | ".join(_cells(report["throughput"], who, levels, "{:.0f}")) + " |"
        )
    counts = report["density_counts"]
    out += [
        "",
        "## Density (memory per idle session, PSS: sandbox plus the caller's process)",
        "",
        "| who | " + " | ".join(f"sessions: {n}, MiB" for n in counts) + " | most sessions the "
        "free memory holds |",
        "|---|" + "---:|" * (len(counts) + 1),
    ]
    for who in report["density"]:
        cells = _cells(report["density"], who, counts, "{:.1f}")
        out.append(f"| {who} | " + " | ".join(cells) + f" | {report['capacity'][who]} |")
    out += [
        "",
        "The last column divides the memory free at the start by the per-session figure "
        "at the largest count; the default limits (2 GiB per session) are ceilings, not "
        "reservations, so memory actually used is what bounds density.",
        "",
        "## Peers",
        "",
    ]
    for name, peer in report["peers"].items():
        out.append(f"- **{name}**: {peer}")
    for name, why in report["not_run"].items():
        out.append(f"- **{name}**: not run: {why}.")
    out += ["", "![latency distributions](latest.png)", ""]
    return "\n".join(out)


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
        "started kernel. Ratio = ours / raw, medians. Raw stops reading at the answer; ours cannot "
        "know the answer, so for Deno's kernels (JavaScript, TypeScript), which may publish output "
        "after their idle status, it waits until the output has been quiet for the language's "
        "`linger_s` (sandbox/languages.py) after the idle. Of few samples, p95 is the largest.",
        "",
        "| language | who | cold start median ms | p95 ms | n | raw median ms | ratio "
        "| round trip median ms | p95 ms | n | raw median ms | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {name: i for i, name in enumerate(LANGUAGES)}
    for row in sorted(figures["rows"], key=lambda r: order[r["language"]]):
        cells = []
        for key in ("cold", "round_trip"):
            part = row[key]
            s = part["stats"]
            cells.append(
                f"{s['median_ms']:.2f} | {s['p95_ms']:.2f} | {s['n']} | "
                f"{part['raw_median_ms']:.2f} | {part['ratio']:.2f}x"
            )
        out.append(f"| {row['language']} | {row['who']} | " + " | ".join(cells) + " |")
    if figures["not_run"]:
        out.append("")
    for what, why in figures["not_run"].items():
        out.append(f"- **{what}**: not run: {why}.")
    return [*out, ""]


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["latency"]
    names = [r["name"] for r in rows]
    data = [[v * 1000 for v in report["samples"][r["name"]]] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    ax.boxplot(data, vert=False, tick_labels=names, showfliers=True)
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log scale)")
    ax.set_title(f"Latency distributions, {report['date']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
