"""Host uids for sandboxes: each live sandbox holds one that no other sandbox on the host holds.

Some kernel quotas are counted per host uid whatever the namespaces: inotify instances, POSIX
message-queue bytes, pending signals, processes. Sandboxes sharing a uid share those quotas, so
one could exhaust another's. A uid is claimed for a sandbox's whole life and given back when it
is closed (only once its processes are gone).

One exception, by design: gVisor machines restored from one saved machine (a template, a
snapshot's forks) run as the uid it was saved with, claimed by the first of them while free and
shared by the others. In gVisor that uid is its sentry's notion, not a host process's: no host
quota is counted on it, and each machine's gofer serves its own workspace alone
(sandbox/backends/gvisor/backend.py).

Claims hold across processes too: each is an exclusive `flock` on a file named after the uid in
a claims directory shared by every orchestrator of this user on the host, so two services (or a
service and a test run) drawing from the same range never hand out the same uid at once. The
kernel drops a dead process's locks with it, so a crash leaks nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import threading
from pathlib import Path

from code_interpreter_wire.errors import BackendUnavailable


def default_claims_dir() -> Path:
    """Root's claims live under /run (gone at reboot, like the processes that held them)."""
    if os.geteuid() == 0 and os.path.isdir("/run"):
        return Path("/run/code-interpreter/uid-claims")
    return Path(f"/tmp/code-interpreter-uid-claims-{os.geteuid()}")


class HostUidPool:
    """Hands out uids `base .. base + count - 1`, one per sandbox, starting at a random one."""

    def __init__(self, base: int, count: int, claims_dir: Path | None = None) -> None:
        if base <= 0 or count <= 0:
            raise ValueError("a uid range needs a positive base and count")
        self.base = base
        self.count = count
        self.claims_dir = claims_dir or default_claims_dir()
        self._held: dict[int, int] = {}  # uid -> the descriptor holding its lock
        self._lock = threading.Lock()  # released from worker threads when a sandbox closes

    def allocate(self) -> int:
        """Claim a free uid; raise BackendUnavailable when every one is held."""
        _make_private_dirs(self.claims_dir)
        start = secrets.randbelow(self.count)
        with self._lock:
            for i in range(self.count):
                uid = self.base + (start + i) % self.count
                if uid not in self._held and (fd := self._claim(uid)) is not None:
                    self._held[uid] = fd
                    return uid
        raise BackendUnavailable(
            f"all {self.count} sandbox uids from {self.base} are in use on this host; close "
            "some sandboxes or widen the range"
        )

    def claim(self, uid: int) -> bool:
        """Claim this very uid (a sandbox restored as it was keeps its uid); whether it was
        free."""
        if not self.base <= uid < self.base + self.count:
            return False
        _make_private_dirs(self.claims_dir)
        with self._lock:
            if uid in self._held or (fd := self._claim(uid)) is None:
                return False
            self._held[uid] = fd
            return True

    def release(self, uid: int) -> None:
        """Give the uid back. Safe to call twice."""
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the lock

    @property
    def in_use(self) -> frozenset[int]:
        """The uids this process holds."""
        with self._lock:
            return frozenset(self._held)

    def _claim(self, uid: int) -> int | None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.claims_dir / str(uid), flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process's sandbox holds it
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd


def _make_private_dirs(path: Path) -> None:
    """Create `path` (0700), or accept it only if it is a real directory of this user's."""
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise BackendUnavailable(
            f"{path} is where sandbox uids are claimed, but it is not a private directory of "
            "this user's (another user could hand out the same uids); remove it"
        )
