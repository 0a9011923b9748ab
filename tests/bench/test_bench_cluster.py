"""The cluster benchmark's own logic: the hop's ratio, creation's p50/p95, three nodes over one,
and its report section.

Pure logic only; `make bench-full` (bench/cluster.py) measures, no test times anything.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.cluster import COLD, HOP, LOCAL, THROUGHPUT_WHO, WARM, Plan, figures_of, section
from bench.report import render
from tests.bench.minimal_report import minimal_report

pytestmark = pytest.mark.unit

PLAN = Plan(runs=3, creations=4, sessions=6, seconds=10.0)


def _figures(**not_run: str) -> dict[str, Any]:
    return figures_of(
        latency={LOCAL: [0.004, 0.002, 0.003], HOP: [0.012, 0.006, 0.009]},  # 3 ms, 9 ms
        creation={COLD: [1.0, 4.0, 2.0, 3.0], WARM: [0.2, 0.1, 0.3, 0.4]},
        # Measured in another order than the report's.
        per_second={THROUGHPUT_WHO[2]: 150.0, THROUGHPUT_WHO[0]: 400.0, THROUGHPUT_WHO[1]: 100.0},
        p=PLAN,
        not_run=not_run,
    )


def test_the_hop_is_a_ratio_of_medians_to_the_local_backend_s() -> None:
    rows = {row["name"]: row for row in _figures()["latency"]}
    assert list(rows) == [LOCAL, HOP]
    assert rows[LOCAL]["ratio"] == 1.0
    assert rows[HOP]["ratio"] == 3.0
    assert rows[HOP]["baseline_median_ms"] == 3.0


def test_creation_keeps_p50_and_p95_of_each_measure() -> None:
    rows = {row["name"]: row["stats"] for row in _figures()["creation"]}
    assert rows[COLD]["median_ms"] == 2500.0
    assert rows[COLD]["p95_ms"] == 4000.0  # of four samples, the largest
    assert rows[WARM]["median_ms"] == 250.0


def test_throughput_is_three_nodes_over_one_in_the_report_s_order() -> None:
    loop = _figures()["throughput"]
    assert loop["three_nodes_over_one"] == 1.5
    assert list(loop["per_second"]) == list(THROUGHPUT_WHO)


def test_nothing_measured_is_no_ratio_and_says_why() -> None:
    figures = figures_of({}, {}, {}, PLAN, {"ray backend": "Ray is not installed"})
    assert figures["latency"] == []
    assert figures["throughput"]["three_nodes_over_one"] is None
    lines = section(figures)
    assert "- **ray backend**: not run: Ray is not installed." in lines
    assert not any("3 nodes / 1 node" in line for line in lines)


def test_the_section_shows_ratios_percentiles_and_the_cores_beside_the_ratio() -> None:
    figures = _figures(**{WARM: "no warm pool"})
    figures["cores"] = 2
    lines = section(figures)
    assert f"| {HOP} | 9.00 | 12.00 | 3.00 | 3 | 3.00 | 3.00x |" in lines
    assert f"| {COLD} | 2500 | 4000 | 1000 | 4000 | 4 |" in lines
    assert "| ray, 1 node | 100 |" in lines
    (ratio,) = [line for line in lines if "3 nodes / 1 node" in line]
    assert ratio.startswith("**3 nodes / 1 node: 1.50x, on 2 cores.**")
    assert "cannot triple" in ratio
    assert f"- **{WARM}**: not run: no warm pool." in lines


def test_make_bench_s_report_includes_the_section_when_measured() -> None:
    report = minimal_report(cluster=_figures())
    assert "## Cluster mode" in render(report)
