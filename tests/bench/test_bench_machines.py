"""The machines benchmark's own logic: ratios to the raw kernel start, goals and verdicts, the
CSV it uploads, and its report section.

Pure logic only; `make bench-full` (bench/machines.py) measures, no test times anything.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest

from bench.machines import (
    BASELINE,
    CHART_POOLED,
    CHART_UNPOOLED,
    SUSPEND,
    TEMPLATE,
    WAKE,
    rows_of,
    sales_csv,
    section,
)
from bench.report import render
from tests.bench.minimal_report import minimal_report

pytestmark = pytest.mark.unit


def _out() -> dict[str, list[float]]:
    return {
        BASELINE: [0.4, 0.5, 0.6],  # median 500 ms
        SUSPEND: [1.2, 1.4],  # median 1300 ms: within 1.5 s
        WAKE: [1.6, 1.8],  # median 1700 ms: past it
        TEMPLATE: [0.2, 0.3, 0.25],  # median 250 ms: 0.5x
        CHART_UNPOOLED: [0.6, 0.6],  # 1.2x
        CHART_POOLED: [0.1, 0.12, 0.2],  # median 120 ms
    }


def _figures(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "plan": {"raw_starts": 3, "pauses": 2, "starts": 3, "charts": 2, "pooled": 3},
        "rows": rows_of(_out(), template),
        "sizes": {"frame_bytes": 100 << 20, "paused_bytes": 160 << 20, "image_bytes": 150 << 20},
        "template": template,
        "csv_bytes": 512 * 1024,
    }


def test_each_measure_is_a_ratio_to_the_raw_start_and_judged_by_its_goal() -> None:
    rows = {r["name"]: r for r in rows_of(_out(), {"pandas_imported": True})}
    assert rows[BASELINE]["ratio"] == 1.0 and "goal" not in rows[BASELINE]
    assert rows[SUSPEND]["met"] and not rows[WAKE]["met"]  # absolute: 1300 ms, 1700 ms
    assert rows[TEMPLATE]["ratio"] == 0.5 and rows[TEMPLATE]["met"]
    assert rows[CHART_UNPOOLED]["ratio"] == pytest.approx(1.2)
    assert not rows[CHART_UNPOOLED]["met"]
    assert rows[CHART_POOLED]["met"] and rows[CHART_POOLED]["goal"] == "<= 150 ms"


def test_a_template_start_without_pandas_imported_misses_its_goal_however_fast() -> None:
    rows = {r["name"]: r for r in rows_of(_out(), {"pandas_imported": False})}
    assert rows[TEMPLATE]["ratio"] == 0.5 and not rows[TEMPLATE]["met"]


def test_the_csv_is_half_a_megabyte_of_rows_the_same_every_time() -> None:
    data = sales_csv()
    assert 512 * 1024 <= len(data) < 512 * 1024 + 64
    assert data == sales_csv()
    rows = list(csv.reader(io.StringIO(data.decode())))
    assert rows[0] == ["day", "store", "units", "price"]
    assert all(len(row) == 4 for row in rows)


def test_the_section_shows_times_goals_verdicts_sizes_and_the_template() -> None:
    figures = _figures({"pandas_imported": True, "prepare_s": 4.2, "bytes": 3 << 19})
    lines = section(figures)
    assert f"| {WAKE} | 1700 | 1800 | 1600 | 1800 | 2 | 3.40x | <= 1500 ms | **no** |" in lines
    assert f"| {TEMPLATE} | 250 | 300 | 200 | 300 | 3 | 0.50x | <= 0.6x | yes |" in lines
    assert (
        "- The paused machine on disk: 160.0 MiB (its checkpoint image 150.0 MiB), holding a "
        "DataFrame of 100.0 MiB (`memory_usage(deep=True).sum()`)."
    ) in lines
    assert (
        "- The template took 4.2 s to make and keeps 1.5 MiB on disk; pandas was imported in "
        "every sandbox restored from it."
    ) in lines
    missing = section(_figures({"pandas_imported": False, "prepare_s": 4.2, "bytes": 1}))
    assert f"| {TEMPLATE} | 250 | 300 | 200 | 300 | 3 | 0.50x | <= 0.6x | **no** |" in missing


def test_make_bench_s_report_includes_the_section_when_measured() -> None:
    report = minimal_report(
        machines=_figures({"pandas_imported": True, "prepare_s": 1.0, "bytes": 1})
    )
    assert "## Machine sandboxes (`gvisor`)" in render(report)
