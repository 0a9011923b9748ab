"""The machine's load through a run, logged at each part's start and end: a ratio read beside
the load it was measured under."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.interleave import host_cpu_seconds

_PRESSURE = Path("/proc/pressure/cpu")


def cpu_pressure() -> float | None:
    """The share of the last 10 s some runnable task waited for a CPU (percent), if told."""
    try:
        return float(_PRESSURE.read_text().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Mark:
    what: str
    at_s: float  # since the run began
    load_1m: float
    load_5m: float
    cpu_pressure_10s: float | None


class LoadLog:
    def __init__(self) -> None:
        self._began = time.monotonic()
        self._cpu = host_cpu_seconds()
        self.marks: list[Mark] = []

    def mark(self, what: str) -> None:
        one, five, _ = os.getloadavg()
        self.marks.append(Mark(what, time.monotonic() - self._began, one, five, cpu_pressure()))

    def figures(self) -> dict[str, Any]:
        wall = time.monotonic() - self._began
        return {
            "marks": [asdict(m) for m in self.marks],
            "wall_s": wall,
            "cpu_s": host_cpu_seconds() - self._cpu,
            "cores": os.cpu_count() or 1,
        }
