"""The least a `make bench` report holds, for tests that render one part of it."""

from __future__ import annotations

from typing import Any


def minimal_report(**parts: Any) -> dict[str, Any]:
    """A report with nothing measured but `parts` (a part's name: its figures)."""
    return {
        "date": "today",
        "machine": "here",
        "kind": "default",
        "cpu_counter": "cgroup v1 cpuacct.usage (ns)",
        "raw_weight": "raw kernels where they are",
        "load": {"marks": [], "wall_s": 60.0, "cpu_s": 30.0, "cores": 2},
        "latency": [],
        "heavy": [],
        "throughput_levels": [1],
        "throughput": {},
        "density_counts": [1],
        "density": {},
        "capacity": {},
        "peers": {},
        "not_run": {},
        **parts,
    }
