"""A paused machine's workspace, copied out of the session and back in.

Copied only while nothing runs in the machine (after its checkpoint, before its restore), and
never through a link: a link in the workspace is copied as a link, a special file (FIFO,
socket, device) is left out, and every file is opened without following a link at its name,
so no file outside the workspace is ever read or written on the sandbox's behalf. Owners,
modes and times are kept. Bounded by the workspace's own quota.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def copy_workspace(source: Path, dest: Path) -> None:
    """Copy the tree under `source` into the existing directory `dest`."""
    pending = [(source, dest)]
    made: list[tuple[Path, os.stat_result]] = []
    while pending:
        from_dir, to_dir = pending.pop()
        with os.scandir(from_dir) as entries:
            for entry in entries:
                here, there = Path(entry.path), to_dir / entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(here), there)
                    os.lchown(there, st.st_uid, st.st_gid)
                elif stat.S_ISDIR(st.st_mode):
                    os.mkdir(there, 0o700)
                    made.append((there, st))
                    pending.append((here, there))
                elif stat.S_ISREG(st.st_mode):
                    _copy_file(here, there)
    for directory, st in reversed(made):  # modes last: a read-only directory was filled first
        os.chown(directory, st.st_uid, st.st_gid)
        os.chmod(directory, stat.S_IMODE(st.st_mode))
        os.utime(directory, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(source: Path, dest: Path) -> None:
    fd = os.open(source, os.O_RDONLY | _NO_FOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return
        out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600)
        with os.fdopen(out, "wb") as writer, os.fdopen(os.dup(fd), "rb") as reader:
            shutil.copyfileobj(reader, writer, 1 << 20)
            os.fchown(writer.fileno(), st.st_uid, st.st_gid)
            os.fchmod(writer.fileno(), stat.S_IMODE(st.st_mode))
            os.utime(writer.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(fd)
