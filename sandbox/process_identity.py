"""Which process owns a resource, recorded so that a later process can prove the owner is gone.

A pid alone proves nothing (pids are reused), so the owner is its pid, its start time in clock
ticks since boot, the boot's id and its PID namespace. Within one boot and namespace, the pid
and start time name exactly one process ever; when boot or namespace differ (another host
sharing a Docker engine, a reboot, a service in a container), nothing can be proved from here,
and the answer is "unknown": clean-up leaves such resources alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class OwnerState(StrEnum):
    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"  # another host, boot or PID namespace: cannot be checked from here


def process_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None when no process of that pid
    runs: none is there, or it has ended and waits to be reaped (a zombie holds nothing, and is
    no owner of what it left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start: str
    boot_id: str
    pid_namespace: str

    @classmethod
    def of_this_process(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, process_start_time(pid) or "", _boot_id(), _pid_namespace())

    def state(self) -> OwnerState:
        if self.boot_id != _boot_id() or self.pid_namespace != _pid_namespace():
            return OwnerState.UNKNOWN
        alive = self.start != "" and process_start_time(self.pid) == self.start
        return OwnerState.ALIVE if alive else OwnerState.GONE

    def labels(self, prefix: str) -> dict[str, str]:
        """As container labels (strings), each name under `prefix`."""
        return {
            f"{prefix}.pid": str(self.pid),
            f"{prefix}.start": self.start,
            f"{prefix}.boot-id": self.boot_id,
            f"{prefix}.pid-namespace": self.pid_namespace,
        }

    @classmethod
    def from_labels(cls, labels: Mapping[str, str], prefix: str) -> ProcessIdentity | None:
        """The owner named by `labels`, or None when they name none (or are malformed)."""
        try:
            return cls(
                int(labels[f"{prefix}.pid"]),
                labels[f"{prefix}.start"],
                labels[f"{prefix}.boot-id"],
                labels[f"{prefix}.pid-namespace"],
            )
        except (KeyError, ValueError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} (started at tick {self.start}, boot {self.boot_id or '?'})"
