"""Memory as the kernel accounts it: PSS, so shared library pages are split fairly."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


def pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pids(root: int) -> list[int]:
    """A process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def memory_cgroup_of(pid: int) -> str:
    """The process's memory cgroup, relative to the memory hierarchy's root ("" if unknown)."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                return path.lstrip("/")
    except (OSError, ValueError):
        pass
    return ""


def pss_of(pids: list[int]) -> int:
    return sum(pss_bytes(p) for p in pids)
