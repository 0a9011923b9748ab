"""The raw kernels' CPU weight, made the sandboxes' own: a fair baseline on a busy host.

Our sandboxes sit under `cpu/code-interpreter`, weighed as one live session each
(sandbox/cgroups.py `rescale_parent`); a raw kernel left in the bench's own group would get
another share of the host, and a ratio under load would weigh the groups, not the code. So each
raw kernel gets a group of its own under a sibling parent, `cpu/cir-bench-raw`, weighed by the
same rule. Where the bench cannot make cgroups (not root, no cgroup v1), raw kernels stay where
they are and the report says so.
"""

from __future__ import annotations

import contextlib
import os
import time

from sandbox import cgroups

RAW_PARENT = cgroups.ROOT / "cpu" / "cir-bench-raw"


def available() -> bool:
    return cgroups.available()


def place(pid: int) -> None:
    """Move a raw kernel into a group of its own, weighed as a live sandbox, and reweigh."""
    if not available():
        return
    group = RAW_PARENT / f"kernel-{pid}"
    group.mkdir(parents=True, exist_ok=True)
    (group / "cpu.shares").write_text(str(cgroups.LIVE_SHARES))
    (group / "cgroup.procs").write_text(str(pid))
    cgroups.rescale_parent(RAW_PARENT)


def release(pid: int, wait_s: float = 5.0) -> None:
    """Remove the group of a raw kernel that has been stopped, then reweigh."""
    group = RAW_PARENT / f"kernel-{pid}"
    deadline = time.monotonic() + wait_s
    while group.is_dir():
        try:
            group.rmdir()
        except OSError:  # its process is still exiting
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
    if RAW_PARENT.is_dir():
        cgroups.rescale_parent(RAW_PARENT)


def clear() -> None:
    """Remove whatever an earlier run left (its kernels are gone: their groups are empty)."""
    if not RAW_PARENT.is_dir():
        return
    for group in RAW_PARENT.iterdir():
        if group.is_dir():
            with contextlib.suppress(OSError):
                group.rmdir()


def where() -> str:
    return (
        f"raw kernels each in a group under {RAW_PARENT} weighed as one live sandbox "
        f"({os.cpu_count()} cores: at most {os.cpu_count()} sessions' weight)"
        if available()
        else "raw kernels in the bench's own cgroup (no cgroup v1 as root here)"
    )
