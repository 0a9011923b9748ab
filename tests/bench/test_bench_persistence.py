"""The pause-and-resume benchmark's own logic: ratios to the baseline, and its report section.

Pure logic only; `make bench` (bench/persistence.py) measures, no test times anything.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.interleave import Sampled
from bench.persistence import BASELINE, MEASURES, rows_of, section
from bench.report import render
from tests.bench.minimal_report import minimal_report

pytestmark = pytest.mark.unit


def _figures() -> dict[str, Any]:
    out = {name: Sampled([1.0], [0.5]) for name in MEASURES}
    out[BASELINE] = Sampled([4.0, 2.0, 3.0], [2.0, 2.0, 2.0])  # median 3 s, 2 s of CPU
    out["resume (POST .../resume)"] = Sampled([1.5, 0.5, 0.75], [0.1, 0.1, 0.1])  # 0.75 s
    return {
        "samples_per_backend": 3,
        "rows": rows_of("docker", out),
        "saved": {"docker": {"snapshot_bytes": 3 << 20, "paused_bytes_on_disk": 5 << 19}},
        "not_run": {"local backend": "bubblewrap is missing"},
    }


def test_each_measure_is_a_ratio_of_medians_to_the_same_backend_s_baseline() -> None:
    rows = {row["name"]: row for row in _figures()["rows"]}
    assert list(rows) == list(MEASURES)
    assert rows[BASELINE]["ratio"] == 1.0
    assert rows["resume (POST .../resume)"]["ratio"] == 0.25
    assert rows["pause"]["baseline_median_ms"] == 3000.0


def test_the_section_shows_times_ratios_bytes_and_what_was_not_run() -> None:
    lines = section(_figures())
    assert (
        "| docker | resume (POST .../resume) | 750 | 500 | 1500 | 3 | 3000 | 0.25x | 100 | 0.05x |"
        in lines
    )
    assert "- **docker**: a snapshot keeps 3.0 MiB; a paused session 2.5 MiB on disk." in lines
    assert "- **local backend**: not run: bubblewrap is missing." in lines


def test_make_bench_s_report_includes_the_section_when_measured() -> None:
    report = minimal_report(persistence=_figures())
    assert "## Pause, resume, snapshots" in render(report)
