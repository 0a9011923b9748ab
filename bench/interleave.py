"""Measures taken in turns, each beside its baseline: the machine's moods fall on all alike.

A part of the bench measured its baseline first and ours minutes later; a machine that slowed in
between (a neighbour, the page cache, a CPU's clock) moved every ratio, and two runs disagreed by
5-10x. Here every measure of a group takes `batch` samples in its turn, round after round, the
order rotated each round, so ours and the baseline share the minutes. Beside each sample's wall
time, the CPU time the whole host spent meanwhile (every process: the client, the service, the
sandbox, the kernel), read from the root cgroup's counter in nanoseconds.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_CPUACCT_V1 = Path("/sys/fs/cgroup/cpuacct/cpuacct.usage")  # nanoseconds, all tasks
_CPU_STAT_V2 = Path("/sys/fs/cgroup/cpu.stat")  # usage_usec, all tasks
_PROC_STAT = Path("/proc/stat")
_TICK_S = 0.01  # USER_HZ: /proc/stat's unit


def host_cpu_seconds() -> float:
    """CPU time every process on the host has spent, as precisely as the host tells it."""
    try:
        return int(_CPUACCT_V1.read_text()) / 1e9
    except (OSError, ValueError):
        pass
    try:
        for line in _CPU_STAT_V2.read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except (OSError, ValueError):
        pass
    first = _PROC_STAT.read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in first[:7])
    return (user + nice + system + irq + softirq) * _TICK_S


def cpu_counter() -> str:
    """Where host_cpu_seconds reads, for the report."""
    if _CPUACCT_V1.exists():
        return "cgroup v1 cpuacct.usage (ns)"
    if _CPU_STAT_V2.exists():
        return "cgroup v2 cpu.stat usage_usec"
    return "/proc/stat (10 ms ticks: per-sample figures are coarse)"


async def quiet(*, busy_cores: float = 0.15, window_s: float = 0.1, limit_s: float = 10.0) -> None:
    """Wait until the host is quiet (under `busy_cores` of CPU over a window), at most
    `limit_s`: what the last sample left running (a sandbox torn down, a container removed, a
    pool refilled) must not fall on the next one, whoever's it is."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        cpu = host_cpu_seconds()
        await asyncio.sleep(window_s)
        if host_cpu_seconds() - cpu < busy_cores * window_s:
            return


class Untimed:
    """Work a sample leaves for later, outside the clock (a session deleted, a kernel stopped):
    the next `prepare`, or the part's end, does it."""

    def __init__(self) -> None:
        self._pending: list[Callable[[], Awaitable[Any]]] = []

    def later(self, work: Callable[[], Awaitable[Any]]) -> None:
        self._pending.append(work)

    async def run(self) -> None:
        while self._pending:
            await self._pending.pop(0)()

    async def settle(self) -> None:
        """Do what was left, then wait for the host to be quiet (its teardown over too)."""
        await self.run()
        await quiet()


@dataclass
class Sampled:
    """One measure's samples: wall seconds, and the host's CPU seconds over each."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Measure:
    """One thing to time: `once` is timed; `prepare`, if any, runs untimed before each."""

    once: Callable[[], Awaitable[Any]]
    prepare: Callable[[], Awaitable[Any]] | None = None


async def interleaved(
    measures: dict[str, Measure], n: int, *, batch: int = 10, warmup: int = 2, settle: bool = True
) -> dict[str, Sampled]:
    """`n` samples of every measure, taken `batch` at a time in turns, once the host is quiet
    (what came before, a part's set-up or teardown, falls on none of them); `settle=False`
    where the host is kept busy on purpose."""
    if settle:
        await quiet()
    names = list(measures)
    for name in names:
        for _ in range(warmup):
            await _one(measures[name], None)
    out = {name: Sampled() for name in names}
    rounds = math.ceil(n / batch)
    for turn in range(rounds):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(min(batch, n - turn * batch)):
                await _one(measures[name], out[name])
    return out


async def _one(measure: Measure, into: Sampled | None) -> None:
    if measure.prepare is not None:
        await measure.prepare()
    cpu = host_cpu_seconds()
    started = time.perf_counter()
    await measure.once()
    wall = time.perf_counter() - started
    if into is not None:
        into.cpu.append(host_cpu_seconds() - cpu)
        into.wall.append(wall)
