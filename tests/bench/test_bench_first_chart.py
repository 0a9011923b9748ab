"""The first-chart benchmark's own logic: ratios to the raw kernel start, the preloaded pools'
goal and verdict, and its report section.

Pure logic only; `make bench` (bench/first_chart.py) measures, no test times anything.
"""

from __future__ import annotations

import pytest

from bench.first_chart import BASELINE, RAW_CHART, RAW_CHART_LOADED, name_of, rows_of, section
from bench.interleave import Sampled
from bench.report import render
from tests.bench.minimal_report import minimal_report

pytestmark = pytest.mark.unit


def _out() -> dict[str, Sampled]:
    walls = {
        BASELINE: [0.4, 0.5, 0.6],  # median 500 ms
        RAW_CHART: [1.0, 1.0],
        name_of("local", False): [0.6, 0.6],
        name_of("local", True): [0.1, 0.12, 0.2],  # median 120 ms: within 150
        name_of("docker", True): [0.2, 0.16, 0.3],  # median 200 ms: past it
        RAW_CHART_LOADED: [2.0, 2.0],
        name_of("local", True, loaded=True): [0.5, 0.5],  # 0.25x the raw under the same load
    }
    # The host's CPU over each sample: the raw start's median 250 ms.
    return {name: Sampled(wall, [w / 2 for w in wall]) for name, wall in walls.items()}


def test_each_row_is_a_ratio_to_the_raw_start_and_only_preloaded_pools_have_the_goal() -> None:
    rows = {r["name"]: r for r in rows_of(_out())}
    assert rows[BASELINE]["ratio"] == 1.0 and "goal" not in rows[BASELINE]
    assert rows[BASELINE]["stats"]["cpu_median_ms"] == 250.0
    assert rows[RAW_CHART]["cpu_ratio"] == 2.0
    assert rows[RAW_CHART]["ratio"] == 2.0
    assert "goal" not in rows[name_of("local", False)]
    assert rows[name_of("local", True)]["met"] and rows[name_of("local", True)]["ratio"] == 0.24
    assert not rows[name_of("docker", True)]["met"]
    assert rows[name_of("docker", True)]["goal"] == "<= 150 ms"
    loaded = rows[name_of("local", True, loaded=True)]
    assert loaded["loaded_ratio"] == 0.25 and loaded["ratio"] == 1.0 and "goal" not in loaded
    assert "loaded_ratio" not in rows[name_of("local", True)]


def test_the_section_renders_in_the_report() -> None:
    figures = {"plan": {"charts": 3}, "rows": rows_of(_out()), "csv_bytes": 512 * 1024}
    lines = section(figures)
    assert lines[0].startswith("## A fresh session to its first chart")
    assert any(
        "local: fresh session to first chart, preloaded pool | 120 |" in ln
        and "| 0.24x | 60 | 0.24x |" in ln
        for ln in lines
    )
    assert any(ln.endswith("| 0.25x |  |  |") for ln in lines)
    assert any(
        "docker: fresh session to first chart, preloaded pool |" in ln and "**no**" in ln
        for ln in lines
    )
    assert "## A fresh session to its first chart" in render(minimal_report(first_chart=figures))
