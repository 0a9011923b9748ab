"""When a sandbox's memory cgroup last ran out of memory, as Linux reports it: cgroup v1's OOM
notification, an eventfd the event loop watches.

The cgroup's OOM-kill counter says that some process of the sandbox was killed for memory, not
which one nor when, and the kernel shares the cgroup with commands: read alone, an OOM kill of
a command made a `kill -9 -1` minutes later look as if the kernel had run out of memory. A
kernel found killed is blamed on memory only if the cgroup also ran out within
`OOM_BEFORE_DEATH_S` of its death (the notification comes just before the kill), as Docker's
engine report is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

# An OOM this shortly before a kernel's death killed it; one earlier killed something else.
OOM_BEFORE_DEATH_S = 5.0
log = logging.getLogger(__name__)


class OomClock:
    """The time of a memory cgroup's last OOM, kept by the running event loop. `close()` it
    before the cgroup is removed (removal signals the eventfd too)."""

    def __init__(self, eventfd: int) -> None:
        self._eventfd = eventfd
        self._loop = asyncio.get_running_loop()
        self._last: float | None = None
        self._loop.add_reader(eventfd, self._take)

    @classmethod
    def open(cls, memory_dir: Path) -> OomClock | None:
        """Watch the memory cgroup at `memory_dir`; None where it cannot be (not cgroup v1)."""
        eventfd = -1
        try:
            eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            control = os.open(memory_dir / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:  # the registration outlives the control file's descriptor
                (memory_dir / "cgroup.event_control").write_text(f"{eventfd} {control}")
            finally:
                os.close(control)
            return cls(eventfd)
        except OSError as exc:
            if eventfd >= 0:
                os.close(eventfd)
            log.warning(
                "no OOM notification for %s (%s): memory is blamed by count", memory_dir, exc
            )
            return None

    def ran_out_shortly_before(self, moment: float) -> bool:
        """Whether the cgroup ran out of memory within `OOM_BEFORE_DEATH_S` before `moment`
        (monotonic time) or since."""
        self._take()  # a notification the loop has not handed over yet came just now
        return self._last is not None and self._last > moment - OOM_BEFORE_DEATH_S

    def close(self) -> None:
        if self._eventfd < 0:
            return
        self._loop.remove_reader(self._eventfd)
        os.close(self._eventfd)
        self._eventfd = -1

    def _take(self) -> None:
        if self._eventfd < 0:
            return
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._eventfd)
            self._last = time.monotonic()
