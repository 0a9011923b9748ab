"""Removing a directory tree the sandboxed code controls: iterative, descriptor-based, any depth.

`shutil.rmtree` recurses once per level (a tree about 1,000 deep raises RecursionError) and its
path-based fallback fails past PATH_MAX. Here the walk is a loop over a `DirStack`: one open per
directory, no recursion, no path longer than one name, and symlinks are removed, never followed.
What the code adds while the removal runs is looked for again a few times.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

from sandbox.dir_stack import DIR_FLAGS, DirStack

log = logging.getLogger(__name__)

_PASSES = 3  # how many times a directory is listed again for entries made during the removal


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove `name` in the directory `parent_fd` and, if it is a directory, all below it.

    Goes on past entries it cannot remove; if the tree is still there at the end, raises the
    first OSError met. A missing `name` raises FileNotFoundError.
    """
    if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
        _unlink(parent_fd, name, unlockable=False)
        return
    errors: list[OSError] = []
    stack = DirStack(parent_fd)
    try:
        pending = [_enter(stack, name)]
        passes = [1]
        while pending:
            names = pending[-1]
            if names:
                entry = names.pop()
                try:
                    st = os.stat(entry, dir_fd=stack.fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        pending.append(_enter(stack, entry))
                        passes.append(1)
                    else:
                        _unlink(stack.fd, entry, unlockable=True)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    errors.append(exc)
                continue
            if passes[-1] < _PASSES and (again := os.listdir(stack.fd)):
                pending[-1] = again  # made while this directory was being emptied
                passes[-1] += 1
                continue
            pending.pop()
            passes.pop()
            done = stack.pop()
            try:
                _rmdir(stack.fd, done, unlockable=stack.depth > 0)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if stack.depth == 0:  # the tree itself is still there: say why
                    raise (errors[0] if errors else exc) from None
                errors.append(exc)
    finally:
        stack.close()


def remove_tree_at(path: Path) -> None:
    """Remove the tree at `path`, whose parent directories are the service's own."""
    parent = os.open(path.parent, DIR_FLAGS)
    try:
        remove_tree(parent, path.name)
    finally:
        os.close(parent)


def _enter(stack: DirStack, name: str) -> list[str]:
    """Open the subdirectory `name` (made readable first if the code locked it) and list it."""
    try:
        stack.push(name)
    except PermissionError:
        _unlock(stack.fd, name)
        stack.push(name)
    try:
        return os.listdir(stack.fd)
    except OSError:
        stack.pop()
        raise


def _unlock(parent_fd: int, name: str) -> None:
    """Give a directory of ours that the code made unreadable (mode 000) its owner's rights
    back: through an O_PATH descriptor, so a symlink swapped in meanwhile is never followed."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    finally:
        os.close(fd)


def _unlink(dir_fd: int, name: str, *, unlockable: bool) -> None:
    _in_directory(os.unlink, dir_fd, name, unlockable)


def _rmdir(dir_fd: int, name: str, *, unlockable: bool) -> None:
    try:
        _in_directory(os.rmdir, dir_fd, name, unlockable)
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # a mount point: never ours to remove
            log.warning("not removing %r: it is a mount point", name)
        raise


def _in_directory(remove: Callable[..., None], dir_fd: int, name: str, unlockable: bool) -> None:
    """`remove(name, dir_fd=dir_fd)`; if the directory was made read-only and is inside the tree
    (`unlockable`: never the caller's own directory, whose mode is not ours to change), open it
    up to its owner again and retry."""
    try:
        remove(name, dir_fd=dir_fd)
    except PermissionError:
        if not unlockable:
            raise
        os.fchmod(dir_fd, 0o700)
        remove(name, dir_fd=dir_fd)
