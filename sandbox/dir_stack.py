"""A path of open directories, from a top one down, for walking trees the sandbox controls.

Each directory is opened from its parent's descriptor with O_NOFOLLOW, never by path: a walk
costs one open per directory whatever the depth (no path is ever longer than PATH_MAX, no
directory is reopened from the root), and no symlink the sandboxed code planted is followed.
Only the deepest `window` directories stay open, so a tree thousands deep cannot exhaust file
descriptors; going back up to a closed one reopens it through `..` and checks it is the very
directory that was left (same device and inode), so moving a directory during the walk cannot
lead it anywhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DEFAULT_WINDOW = 32


class TreeChanged(OSError):
    """A directory was moved while a walk was inside it."""


@dataclass
class _Level:
    name: str  # in its parent
    fd: int | None  # None once it has left the window
    device: int
    inode: int


class DirStack:
    """The directories from a top one (borrowed, never closed) down to the current one."""

    def __init__(self, top_fd: int, *, window: int = DEFAULT_WINDOW) -> None:
        self.top_fd = top_fd
        self.window = max(2, window)
        self._levels: list[_Level] = []

    @property
    def depth(self) -> int:
        """How many directories below the top the walk is."""
        return len(self._levels)

    @property
    def fd(self) -> int:
        """The current directory's descriptor (always open)."""
        if not self._levels:
            return self.top_fd
        fd = self._levels[-1].fd
        assert fd is not None
        return fd

    def push(self, name: str) -> int:
        """Enter the subdirectory `name` of the current one; raises OSError if it is not one."""
        fd = os.open(name, DIR_FLAGS, dir_fd=self.fd)
        st = os.fstat(fd)
        self._levels.append(_Level(name, fd, st.st_dev, st.st_ino))
        leaving = len(self._levels) - 1 - self.window
        if leaving >= 0 and (old := self._levels[leaving].fd) is not None:
            os.close(old)
            self._levels[leaving].fd = None
        return fd

    def pop(self) -> str:
        """Leave the current directory for its parent; return the name it has there."""
        child = self._levels.pop()
        assert child.fd is not None
        try:
            if self._levels and self._levels[-1].fd is None:
                self._levels[-1].fd = self._reopen_parent(child.fd, self._levels[-1])
        finally:
            os.close(child.fd)
        return child.name

    @staticmethod
    def _reopen_parent(child_fd: int, parent: _Level) -> int:
        fd = os.open("..", DIR_FLAGS, dir_fd=child_fd)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (parent.device, parent.inode):
            os.close(fd)
            raise TreeChanged(f"the directory {parent.name!r} was moved during the walk")
        return fd

    def close(self) -> None:
        """Close every descriptor the stack opened (the top one stays open)."""
        while self._levels:
            fd = self._levels.pop().fd
            if fd is not None:
                os.close(fd)
