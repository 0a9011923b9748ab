"""The bench's turns (bench/interleave.py): who is sampled when, what is left outside the clock,
and the report's sections on the run's load and on density.

Pure logic only: the measures here record the order they are called in; no test times anything.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from bench import interleave
from bench.agreement import compare
from bench.interleave import Measure, Sampled, Untimed, host_cpu_seconds, interleaved
from bench.report import render
from bench.stats import summarize_sampled
from tests.bench.minimal_report import minimal_report

pytestmark = pytest.mark.unit


def _recorder(calls: list[str], name: str) -> Measure:
    async def once() -> None:
        calls.append(name)

    async def prepare() -> None:
        calls.append(f"prepare {name}")

    return Measure(once, prepare)


def test_each_measure_takes_its_batch_in_turn_and_the_order_rotates_each_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def at_once() -> None:  # a busy test machine is never quiet: no wait for it here
        pass

    monkeypatch.setattr(interleave, "quiet", at_once)
    calls: list[str] = []
    measures = {name: _recorder(calls, name) for name in ("raw", "ours")}
    out = asyncio.run(interleaved(measures, 5, batch=2, warmup=1))
    timed = [c for c in calls if not c.startswith("prepare")]
    warm_ups = ["raw", "ours"]
    rounds = [["raw", "raw", "ours", "ours"], ["ours", "ours", "raw", "raw"], ["raw", "ours"]]
    assert timed == warm_ups + [name for turn in rounds for name in turn]
    assert calls.count("prepare raw") == 6  # before every call, the warm-up's too
    assert {name: len(s.wall) for name, s in out.items()} == {"raw": 5, "ours": 5}
    assert all(len(s.cpu) == len(s.wall) for s in out.values())
    assert all(c >= 0 for s in out.values() for c in s.cpu)


def test_work_left_for_later_runs_outside_the_clock_in_the_order_it_was_left() -> None:
    done: list[str] = []
    after = Untimed()

    async def note(what: str) -> None:
        done.append(what)

    after.later(lambda: note("stop the kernel"))
    after.later(lambda: note("delete the session"))
    asyncio.run(after.run())
    asyncio.run(after.run())  # nothing is done twice
    assert done == ["stop the kernel", "delete the session"]


def test_the_host_cpu_counter_only_grows() -> None:
    first = host_cpu_seconds()
    sum(i * i for i in range(200_000))  # some CPU, however little
    assert host_cpu_seconds() >= first > 0


def test_the_report_shows_the_run_s_load_and_a_preloaded_session_beside_a_bare_one() -> None:
    report = minimal_report(
        density_counts=[10, 20],
        density={
            "raw": {"10": 40.0, "20": 40.0},
            "local": {"10": 50.0, "20": 48.0},
            "local, preloaded": {"10": 80.0, "20": 72.0},
        },
        capacity={"raw": 500, "local": 400, "local, preloaded": 300},
        load={
            "marks": [
                {
                    "what": "latency: start",
                    "at_s": 0.0,
                    "load_1m": 0.5,
                    "load_5m": 0.25,
                    "cpu_pressure_10s": 1.5,
                }
            ],
            "wall_s": 600.0,
            "cpu_s": 300.0,
            "cores": 2,
        },
    )
    text = render(report)
    assert "10.0 minutes, the host's CPU busy 300 s of 1200 s" in text
    assert "| latency: start | 0 | 0.50 | 0.25 | 1.5 |" in text
    assert "| local, preloaded | 80.0 (2.00x) | 72.0 (1.80x) | 1.50x | 300 |" in text
    assert "| local | 50.0 (1.25x) | 48.0 (1.20x) |  | 400 |" in text


def _run(kind: str, http_ratio: float, cpu_ratio: float) -> dict[str, object]:
    shown = {"stats": summarize_sampled(Sampled([0.004], [0.005])), "baseline_median_ms": 4.0}
    return minimal_report(
        kind=kind,
        date=f"run {http_ratio}",
        latency=[
            {"name": "raw: 1+1", "baseline": "raw: 1+1", "ratio": 1.0, "cpu_ratio": 1.0, **shown},
            {
                "name": "service: 1+1 via HTTP",
                "baseline": "raw: 1+1",
                "ratio": http_ratio,
                "cpu_ratio": cpu_ratio,
                **shown,
            },
        ],
        density_counts=[20],
        density={"raw": {"20": 40.0}, "local": {"20": 60.0}},
        capacity={"raw": 1, "local": 1},
    )


def test_two_runs_agree_when_every_ratio_moved_at_most_a_fifth() -> None:
    common, moved = compare(_run("default", 1.5, 2.0), _run("default", 1.3, 2.1))
    assert common == 3  # a baseline's ratio to itself is not counted
    assert moved == []
    common, moved = compare(_run("default", 1.5, math.nan), _run("default", 1.1, 2.0))
    assert common == 2 and [m.name for m in moved] == ["latency: service: 1+1 via HTTP"]
    assert moved[0].change == pytest.approx(0.4 / 1.5)


def test_the_report_says_how_it_agrees_with_the_previous_run() -> None:
    text = render(_run("default", 2.0, 2.0), _run("default", 1.0, 2.0))
    assert "2 of 3 ratios both runs measured agree within 20%" in text
    assert "| latency: service: 1+1 via HTTP | 1.00x | 2.00x | 50% |" in text
    assert "No earlier run of this kind" in render(_run("default", 2.0, 2.0))
