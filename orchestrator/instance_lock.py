"""One live service per state dir, held by a lock for the service's whole life.

What a service finds in its state dir at start it takes for a crash's leftovers: it empties the
kept outputs and clears orphans. A second instance on the same state dir (and so, by default,
the same orchestrator id) would do that to a live service, so it must stop first, before
touching anything, and say who holds the dir.

The lock is an exclusive `flock` on `<state dir>/service.lock`, which records the holder's pid.
The kernel drops it when the holder exits, however it exits: a crash leaves nothing to clean.
A hand-written lock rather than a library's: the file must never be truncated by a contender
(it names the holder), and the holder's pid must be read back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

LOCK_FILE = "service.lock"


class InstanceAlreadyRunning(RuntimeError):
    """Another live service holds this state dir."""


class InstanceLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: Path, orchestrator_id: str) -> InstanceLock:
        """Take the state dir's lock, or raise InstanceAlreadyRunning naming its holder."""
        state_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        path = state_dir / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise InstanceAlreadyRunning(
                f"another instance of the service ({holder}) holds {path}: only one may run "
                f"per state dir, and this one (orchestrator id {orchestrator_id!r}) would clear "
                "that instance's sandboxes and outputs. Stop the other instance, or give this "
                "one a state dir and an orchestrator id of its own "
                "(CODE_INTERPRETER_STATE_DIR, CODE_INTERPRETER_ORCHESTRATOR_ID)."
            ) from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({"pid": os.getpid(), "orchestrator_id": orchestrator_id}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        return cls(path, fd)

    def release(self) -> None:
        """Let another instance start. Safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor drops the lock


def _read_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(record['pid'])}, orchestrator id {record['orchestrator_id']!r}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown: it is still starting"
