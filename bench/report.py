"""The benchmark's outputs: a markdown report, the JSON behind it, and a chart of latencies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    out += [
        "",
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
