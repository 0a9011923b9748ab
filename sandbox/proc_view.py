"""What a local sandbox sees of the host-wide files in /proc.

bwrap's /proc is the sandbox's own for processes, but files such as /proc/meminfo, /proc/stat
and /proc/pressure/* describe the whole host: its memory, its load, other tenants' activity.
Those that tools rely on (meminfo, stat, loadavg) are replaced by files describing the sandbox's
own limits; the others are masked (bound to /dev/null, which the sandbox cannot open).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from code_interpreter_wire.spec import ResourceLimits

MASKED = (
    "/proc/vmstat", "/proc/zoneinfo", "/proc/diskstats", "/proc/interrupts", "/proc/softirqs",
    "/proc/swaps", "/proc/keys", "/proc/key-users", "/proc/timer_list", "/proc/sched_debug",
    "/proc/kcore", "/proc/buddyinfo", "/proc/pagetypeinfo", "/proc/slabinfo", "/proc/schedstat",
    "/proc/partitions", "/proc/vmallocinfo", "/proc/iomem", "/proc/ioports", "/proc/kallsyms",
    "/proc/pressure/cpu", "/proc/pressure/io", "/proc/pressure/memory", "/proc/pressure/irq",
    "/proc/locks", "/proc/modules", "/proc/sys/fs/file-nr",
    "/proc/sys/fs/inode-nr",
)  # fmt: skip


def masked_present() -> list[str]:
    """The masked files this host has (a bind needs its target to exist)."""
    return [p for p in MASKED if os.path.exists(p)]


def synthetic_files(limits: ResourceLimits) -> dict[str, bytes]:
    """/proc files rewritten to describe the sandbox: its memory limit, its CPUs, no load."""
    kb = limits.memory_mb << 10
    meminfo = "".join(
        f"{name + ':':<16}{value:>8} kB\n"
        for name, value in (
            ("MemTotal", kb), ("MemFree", kb), ("MemAvailable", kb), ("Buffers", 0),
            ("Cached", 0), ("SwapCached", 0), ("Active", 0), ("Inactive", 0),
            ("SwapTotal", 0), ("SwapFree", 0), ("Dirty", 0), ("Shmem", 0), ("Slab", 0),
            ("SReclaimable", 0), ("SUnreclaim", 0),
        )
    )  # fmt: skip
    cpus = max(1, min(math.ceil(limits.cpus), os.cpu_count() or 1))
    idle = "0 0 0 0 0 0 0 0 0 0"
    stat = f"cpu  {idle}\n" + "".join(f"cpu{i} {idle}\n" for i in range(cpus))
    stat += f"intr 0\nctxt 0\nbtime {_boot_time()}\nprocesses 0\nprocs_running 1\n"
    stat += "procs_blocked 0\nsoftirq 0\n"
    return {
        "/proc/meminfo": meminfo.encode(),
        "/proc/stat": stat.encode(),
        "/proc/loadavg": b"0.00 0.00 0.00 1/1 1\n",
    }


def _boot_time() -> int:
    """The host's boot time (also what /proc/uptime tells), so clocks derived from it agree."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
