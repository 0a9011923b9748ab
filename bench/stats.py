"""Timing samples and their summary: median, p95 and spread."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.interleave import Sampled


def summarize(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median_ms": statistics.median(ordered) * 1000,
        # Nearest rank: of few samples (cold starts), the largest, never one below the median.
        "p95_ms": ordered[math.ceil(len(ordered) * 0.95) - 1] * 1000,
        "min_ms": ordered[0] * 1000,
        "max_ms": ordered[-1] * 1000,
        "stdev_ms": (statistics.stdev(ordered) if len(ordered) > 1 else 0.0) * 1000,
    }


async def timed(n: int, once: Callable[[], Awaitable[Any]], warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        await once()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await once()
        samples.append(time.perf_counter() - t)
    return samples


def peak_rss_mb() -> float:
    """This process's peak resident memory so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def beside(sampled: Sampled, baseline: Sampled) -> dict[str, Any]:
    """A measure's summary beside its baseline's: the ratio of their medians, and of the
    host's CPU time over a sample."""
    stats, base = summarize_sampled(sampled), summarize_sampled(baseline)
    return {
        "stats": stats,
        "baseline_median_ms": base["median_ms"],
        "ratio": stats["median_ms"] / base["median_ms"],
        "cpu_ratio": stats["cpu_median_ms"] / base["cpu_median_ms"],
    }


def summarize_sampled(sampled: Sampled) -> dict[str, float]:
    """`summarize` of the wall times, with the median of the host's CPU time per sample."""
    out = summarize(sampled.wall)
    out["cpu_median_ms"] = statistics.median(sampled.cpu) * 1000 if sampled.cpu else math.nan
    return out
