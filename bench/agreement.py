"""Whether a run agrees with the one before it: every ratio both measured, side by side.

A bench is trusted when two runs on a quiet machine tell the same story: each run's report
lists the ratios that moved more than `TOLERANCE` since the previous run of the same kind
(bench/results/previous.json, kept by report.write). `python -m bench.agreement A.json B.json`
compares any two.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.first_chart import BASELINE as FIRST_CHART_BASELINE
from bench.persistence import BASELINE as PERSISTENCE_BASELINE

TOLERANCE = 0.20


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """Every ratio of a report but a baseline's to itself, by a name the same in every run."""
    out: dict[str, float] = {}
    for row in report.get("latency", []):
        if row["name"] == row["baseline"]:
            continue
        out[f"latency: {row['name']}"] = row["ratio"]
        out[f"latency, CPU: {row['name']}"] = row.get("cpu_ratio", math.nan)
    for row in report.get("languages", {}).get("rows", []):
        if row["who"] == "raw":
            continue
        for key in ("cold", "round_trip"):
            what = f"languages: {row['language']}, {row['who']}, {key}"
            out[what] = row[key]["ratio"]
            out[f"{what}, CPU"] = row[key].get("cpu_ratio", math.nan)
    for row in report.get("first_chart", {}).get("rows", []):
        if row["name"] == FIRST_CHART_BASELINE:
            continue
        out[f"first chart: {row['name']}"] = row["ratio"]
        if "loaded_ratio" in row:
            out[f"first chart: {row['name']}, vs raw loaded"] = row["loaded_ratio"]
    for row in report.get("persistence", {}).get("rows", []):
        if row["name"] == PERSISTENCE_BASELINE:
            continue
        out[f"persistence: {row['backend']}, {row['name']}"] = row["ratio"]
    density = report.get("density", {})
    for who, by_count in density.items():
        for count, mib in by_count.items():
            raw = density.get("raw", {}).get(count)
            if who != "raw" and raw:
                out[f"density: {who}, {count} sessions"] = mib / raw
    return {name: value for name, value in out.items() if math.isfinite(value) and value > 0}


@dataclass(frozen=True)
class Moved:
    name: str
    before: float
    now: float

    @property
    def change(self) -> float:
        """How far `now` is from `before`, as a share of the larger of the two."""
        return abs(self.now - self.before) / max(self.now, self.before)


def compare(
    now: dict[str, Any], before: dict[str, Any], tolerance: float = TOLERANCE
) -> tuple[int, list[Moved]]:
    """How many ratios both runs have, and those that moved more than `tolerance`."""
    mine, theirs = ratios(now), ratios(before)
    common = [name for name in mine if name in theirs]
    moved = [Moved(name, theirs[name], mine[name]) for name in common]
    return len(common), [m for m in moved if m.change > tolerance]


def section(now: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    """The report's section on agreement with the previous run of the same kind."""
    out = ["## Against the previous run", ""]
    if before is None:
        return [*out, "No earlier run of this kind to compare with.", ""]
    common, moved = compare(now, before)
    out.append(
        f"The previous `{before.get('kind', 'default')}` run ({before['date']}): "
        f"{common - len(moved)} of {common} ratios both runs measured agree within "
        f"{TOLERANCE:.0%} (the change over the larger of the two)."
    )
    if moved:
        out += ["", "| ratio | before | now | change |", "|---|---:|---:|---:|"]
        for m in sorted(moved, key=lambda m: -m.change):
            out.append(f"| {m.name} | {m.before:.2f}x | {m.now:.2f}x | {m.change:.0%} |")
    return [*out, ""]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("now", type=Path)
    args = parser.parse_args()
    loaded = [json.loads(p.read_text()) for p in (args.now, args.before)]
    print("\n".join(section(loaded[0], loaded[1])))
